"""The bundled demo models: small LlamaGen-format models trained on procedural images (tools/)."""
from pathlib import Path

DEMO_DIR = Path(__file__).resolve().parent.parent / "demo"
DEMO_AR = DEMO_DIR / "demo_c2i.safetensors"
DEMO_VQ = DEMO_DIR / "demo_vq.safetensors"
DEMO_CLASSIFIER = DEMO_DIR / "demo_classifier.safetensors"
DEMO_DRAFTER = DEMO_DIR / "demo_drafter"  # EAGLE head for DEMO_AR (LANTERN's folder format)
