"""Tiny random LlamaGen models for tests. Every weight is re-drawn from N(0, 0.2): the official head is
zero-initialised, so a freshly built model would give constant logits and hide mistakes."""
import torch

from fastar.model_loaders.llamagen.model import LlamaGenConfig, LlamaGenGPT
from fastar.model_loaders.shared.protocol import CaptionConditioning, ClassConditioning

NUM_CLASSES = 10
CAPTION_TOKENS = 6
CAPTION_DIM = 24


def tiny_config(model_type: str = "c2i", **overrides) -> LlamaGenConfig:
    conditioning = (dict(num_classes=NUM_CLASSES) if model_type == "c2i"
                    else dict(caption_dim=CAPTION_DIM, cls_token_num=CAPTION_TOKENS))
    fields = dict(dim=32, n_layer=2, n_head=4, vocab_size=50, grid=(4, 4), model_type=model_type, ffn_hidden=48,
                  **conditioning)
    return LlamaGenConfig(**{**fields, **overrides})


def tiny_model(model_type: str = "c2i", seed: int = 0, **overrides) -> LlamaGenGPT:
    model = LlamaGenGPT(tiny_config(model_type, **overrides))
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for tensor in model.state_dict().values():
            tensor.copy_(torch.randn(tensor.shape, generator=generator) * 0.2)
    return model.eval()


def tiny_conditioning(model: LlamaGenGPT, seed: int = 1):
    """Two rows: labels for c2i; for t2i, captions with 2 and 4 padded (leading) positions."""
    generator = torch.Generator().manual_seed(seed)
    if model.cfg.model_type == "c2i":
        return ClassConditioning(torch.tensor([3, 7]))
    mask = torch.arange(CAPTION_TOKENS)[None, :] >= torch.tensor([[2], [4]])
    return CaptionConditioning(torch.randn(2, CAPTION_TOKENS, CAPTION_DIM, generator=generator), mask)


def tiny_tokens(model: LlamaGenGPT, seed: int = 2) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, model.vocab_size, (2, model.cfg.num_tokens), generator=generator)
