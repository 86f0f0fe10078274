"""Measuring: what one rank holds and how long it takes (memory meters, synchronized timing,
medians and paired intervals), the per-op overlap benchmark and the ring's schedule bound, the
timeline of one block, every transfer seen from outside the library (and every collective at
PyTorch's dispatcher), the activation memory formula a test checks against measured bytes, and
what `guard(model)` costs."""
