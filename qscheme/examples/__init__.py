"""Small runnable examples shipped with qscheme (``python -m qscheme.examples.make_checkpoint``)."""
