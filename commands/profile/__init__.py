"""``python -m fastar profile``: time per step of every decoder at real model sizes with random weights,
against the memory-bandwidth floor (``speed``; MAR's shapes in ``mar``, shared timing in ``common``), and
the plain loops of the official code it is compared with (``loop_baselines``).
"""
