"""Loops of a few forwards: VAR's next-scale sampler (one forward per scale), Distilled Decoding students (one or
two forwards) and the flow-matching map that turns noise into codes for both."""
