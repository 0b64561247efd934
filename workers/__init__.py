"""Worker roles (actor, critic, reference, reward model) that live in Ray actors."""
