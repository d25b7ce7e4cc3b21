"""The bundled demo models: small models in the official formats, trained on procedural images (tools/)."""
from __future__ import annotations

from pathlib import Path

DEMO_DIR = Path(__file__).resolve().parents[2] / "demo"
DEMO_AR = DEMO_DIR / "demo_c2i.safetensors"
DEMO_VQ = DEMO_DIR / "demo_vq.safetensors"
DEMO_CLASSIFIER = DEMO_DIR / "demo_classifier.safetensors"
DEMO_DRAFTER = DEMO_DIR / "demo_drafter"  # EAGLE head for DEMO_AR (LANTERN's folder format)
DEMO_KL = DEMO_DIR / "demo_kl_vae.safetensors"  # KL autoencoder (LDM format) for the MAR demo
DEMO_MAR = DEMO_DIR / "demo_mar.safetensors"  # MAR target on DEMO_KL's latents
DEMO_MAR_DRAFT = DEMO_DIR / "demo_mar_draft.safetensors"  # smaller MAR on the same latents (CSpD's draft)
DEMO_VAR_VQVAE = DEMO_DIR / "demo_var_vqvae.safetensors"  # multi-scale VQVAE (VAR's format) for the VAR demo
DEMO_VAR = DEMO_DIR / "demo_var.safetensors"  # VAR on DEMO_VAR_VQVAE's scales
DEMO_VAR_DD = DEMO_DIR / "demo_var_dd.safetensors"  # VAR-DD student of DEMO_VAR (python -m fastar distill-dd)
DEMO_DD = DEMO_DIR / "demo_dd.safetensors"  # Distilled Decoding student of DEMO_AR (python -m fastar distill-dd)
DEMO_TEXT = DEMO_DIR / "demo_text"  # text-to-image demo: a Lumina-mGPT-format HF folder with its own tokenizer
DEMO_VQGAN = DEMO_DIR / "demo_vqgan.safetensors"  # its image decoder: DEMO_VQ converted to Chameleon's VQGAN format
DEMO_TEXT_DRAFTER = DEMO_DIR / "demo_text_drafter"  # EAGLE head for DEMO_TEXT (python -m fastar train-drafter)


IMAGE_DECODERS = {DEMO_AR: DEMO_VQ, DEMO_DD: DEMO_VQ, DEMO_TEXT: DEMO_VQGAN, DEMO_MAR: DEMO_KL,
                  DEMO_VAR: DEMO_VAR_VQVAE, DEMO_VAR_DD: DEMO_VAR_VQVAE}


def demo_image_decoder(model_path) -> Path | None:
    """The bundled image decoder a bundled model was trained with (a DD student: its teacher's); None for any
    other model."""
    resolved = Path(model_path).resolve()
    return next((vq for model, vq in IMAGE_DECODERS.items() if model.resolve() == resolved), None)


DRAFTERS = {DEMO_AR: DEMO_DRAFTER, DEMO_TEXT: DEMO_TEXT_DRAFTER, DEMO_MAR: DEMO_MAR_DRAFT}


def demo_drafter(model_path) -> Path | None:
    """The bundled drafter of a bundled model (the EAGLE heads of the class and text demos, the draft MAR of the MAR
    demo) when it is there; None for any other model."""
    drafter = demo_drafter_path(model_path)
    return drafter if drafter is not None and drafter.exists() else None


def demo_drafter_path(model_path) -> Path | None:
    """Where a bundled model's drafter belongs (``train-drafter`` writes it there), whether or not it is there."""
    resolved = Path(model_path).resolve()
    return next((drafter for model, drafter in DRAFTERS.items() if model.resolve() == resolved), None)
