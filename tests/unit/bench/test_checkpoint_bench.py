"""`rlhf bench checkpoint` saves each way through the checkpoint manager and prints each figure
beside its baseline (the figures themselves are on docs/benchmarks pages, not checked here)."""


def test_the_checkpoint_bench_prints_save_manifest_and_verify_lines(bench_lines, tmp_path):
    lines = bench_lines("checkpoint", "--layers", "1", "--hidden", "32", "--vocab", "320",
                        "--repeats", "1", "--folder", str(tmp_path))
    assert [(line["what"], line.get("mode")) for line in lines] == [
        ("save", "sync"), ("save", "background"), ("manifest", None), ("verify", None)]
    sync, background, manifest, verify = lines
    assert sync["blocked_s"] == sync["total_s"] and sync["blocked_of_sync"] == 1.0
    # blocked until the host copy is made, total until published: never less than blocked
    assert 0 < background["blocked_s"] <= background["total_s"]
    ratio = background["blocked_s"] / sync["blocked_s"]
    assert abs(background["blocked_of_sync"] - ratio) <= 0.01 * ratio
    assert background["checkpoint_mb"] == sync["checkpoint_mb"] > 0
    assert manifest["hashed_as_written_s"] > 0 and manifest["rehashed_s"] > 0
    assert {"full_cold_s", "quick_cold_s", "of_full_cold", "full_warm_s", "quick_warm_s",
            "of_full_warm"} <= set(verify)
    assert list(tmp_path.iterdir()) == []  # its temporary folder is gone
