"""Demo fixtures: what the quickstart, the examples and the tests run on without a model hub.

- `tiny_model.py`: tiny random-init folders of every family in `rlhf.families`, from a spec.
- `tiny_tokenizer.py`: the byte-level BPE tokenizer those folders carry.
- `arithmetic_data.py`: the synthetic integer tasks of the quickstart.
- `calculator_data.py`: the calculator tool-use example's problems and traces.
"""
