"""Model families: architectures and checkpoint readers. The front doors pick the loader from the keys."""
from .checkpoint import AR_MODEL, VQ_TOKENIZER, read_state_dict, require_family
from .llamagen import load_llamagen, load_vq

LOADERS = {"llamagen-gpt": load_llamagen, "llamagen-gpt-hf": load_llamagen, "llamagen-vq": load_vq}


def load_ar_model(path, **kw):
    """The token-AR model in a checkpoint file or folder; ``kw`` go to the family's loader."""
    return load_family(path, AR_MODEL, kw)


def load_vq_model(path, **kw):
    """The VQ tokenizer/decoder in a checkpoint file or folder; ``kw`` go to the family's loader."""
    return load_family(path, VQ_TOKENIZER, kw)


def load_family(path, kind: str, kw: dict):
    sd, info = read_state_dict(path)
    return LOADERS[require_family(sd, info.source, kind)](sd, info=info, **kw)
