"""``python -m fastar bench``: decoders measured side by side on the bundled demo models (bench.md).

``decoders`` (the token decoders), ``mar`` (MAR's masked decoders) and ``dd`` (next-scale and distilled)
share ``common``; the demo's procedural images (``demo_data``) are the reference, the demo classifier
(``classifier``) the judge, and the enumerable ``toy_model`` the exact target for fidelity.
"""
