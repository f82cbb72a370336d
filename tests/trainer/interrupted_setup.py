"""`python -m tests.trainer.interrupted_setup OVERRIDES`: `python -m trainer OVERRIDES` with a
Ctrl-C (KeyboardInterrupt) while the model is being built, before the first step."""

from __future__ import annotations

if __name__ == "__main__":
    import trainer.train

    def _interrupted(cfg, run_dir) -> None:
        raise KeyboardInterrupt  # Ctrl-C while the model is being built

    trainer.train.train = _interrupted
    from trainer.__main__ import main

    main()
