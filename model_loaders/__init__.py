"""Model families: architectures and checkpoint readers. The front doors pick the loader from the keys."""
from .checkpoint import AR_MODEL, IMAGE_DECODER, read_state_dict, require_family
from .dd import load_dd_student
from .llamagen import load_llamagen, load_vq
from .mar import load_kl_vae, load_mar

LOADERS = {"llamagen-dd": load_dd_student, "llamagen-gpt": load_llamagen, "llamagen-gpt-hf": load_llamagen,
           "mar": load_mar, "llamagen-vq": load_vq, "kl-vae": load_kl_vae}


def load_ar_model(path, **kw):
    """The generative model (token-AR, MAR or a DD student) in a checkpoint file or folder; ``kw`` go to the
    family's loader."""
    return load_family(path, AR_MODEL, kw)


def load_image_decoder(path, **kw):
    """The image decoder (VQ tokenizer or KL autoencoder) in a checkpoint file or folder."""
    return load_family(path, IMAGE_DECODER, kw)


def load_family(path, kind: str, kw: dict):
    sd, info = read_state_dict(path)
    return LOADERS[require_family(sd, info.source, kind)](sd, info=info, **kw)
