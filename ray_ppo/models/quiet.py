"""Keep ``transformers`` quiet: one line per step is ours to print. A leaf module, so both the
model factories (``hf``) and the tiny-model builder (``tiny``) use it without importing each other."""


def quiet_transformers() -> None:
    """Silence per-load progress bars and info logs."""
    from transformers.utils import logging

    logging.disable_progress_bar()
    logging.set_verbosity_error()
