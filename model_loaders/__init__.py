"""Model families: architectures and checkpoint readers. The front doors pick the loader from the keys."""
from ..errors import FastARError
from ..torch_version import check_torch_version
from .chameleon.loader import load_chameleon, load_vqgan
from .shared.checkpoint import AR_MODEL, IMAGE_DECODER, detect_family, read_state_dict, require_family
from .dd.loader import load_dd_student
from .janus.loader import load_janus, vq_of_janus
from .llamagen.loader import load_llamagen, load_vq
from .mar.loader import load_kl_vae, load_mar
from .shared.quantized import format_to_load, quantised_loading
from .shared.streaming import make_streamable
from .var.loader import load_var, load_var_dd, load_var_vqvae

LOADERS = {"llamagen-dd": load_dd_student, "llamagen-gpt": load_llamagen, "llamagen-gpt-hf": load_llamagen,
           "mar": load_mar, "chameleon": load_chameleon, "janus": load_janus, "var": load_var,
           "var-dd": load_var_dd, "var-vqvae": load_var_vqvae,
           "llamagen-vq": load_vq, "kl-vae": load_kl_vae, "chameleon-vqgan": load_vqgan}


def load_ar_model(path, weights: str = "auto", **kw):
    """The generative model (token-AR, MAR or a DD student) in a checkpoint file or folder; ``kw`` go to the
    family's loader. Its blocks can stream from host memory where the GPU is too small (streaming.py), and hold
    8-bit weights (``weights`` int8 or fp8, quantized.py; a pre-quantised checkpoint's own with ``auto``)."""
    check_torch_version()
    sd, info = read_state_dict(path)
    weights = format_to_load(info.metadata, weights, info.source)
    if weights == "auto":
        model = make_streamable(load_family(sd, info, AR_MODEL, kw))
    else:  # quantised in host memory as it loads, then moved: a model too big for the GPU in bf16 may fit in 8 bits
        with quantised_loading(weights, kw.get("dtype")):
            model = load_family(sd, info, AR_MODEL, kw | {"device": "cpu"})  # streamable too
        model = model.to(kw["device"]) if kw.get("device") is not None else model
    model.defaults = info.fastar_defaults()  # what the front ends take where the user gives no value
    return model


def load_image_decoder(path, **kw):
    """The image decoder (VQ tokenizer, KL autoencoder, VQGAN) in a checkpoint file or folder; a model folder
    whose weights include its VQ model (``model.vqmodel.*``) gives that."""
    sd, info = read_state_dict(path)
    sd = embedded_image_decoder(sd, info)
    return LOADERS[require_family(sd, info.source, IMAGE_DECODER)](sd, info=info, **kw)


EMBEDDED_VQ = "model.vqmodel."


def embedded_image_decoder(sd: dict, info) -> dict:
    """The VQ model inside a model folder (Janus's ``gen_vision_model.*``, converted ``model.vqmodel.*``),
    renamed as a VQ file has it; other state dicts as they are."""
    if detect_family(sd) == "janus":
        return vq_of_janus(sd, converted=EMBEDDED_VQ + "decoder.conv_in.weight" in sd)
    inner = {k[len(EMBEDDED_VQ):]: v for k, v in sd.items() if k.startswith(EMBEDDED_VQ)}
    if not inner:
        return sd
    if not any(k.startswith("decoder.") for k in inner):
        raise FastARError(f"{info.source} carries its VQ model without the decoder (transformers' Chameleon conversion "
                          "keeps only the encoder): load Meta's vqgan.ckpt (Chameleon's release, with vqgan.yaml) "
                          "as the image decoder (FastAR's docs/models.md says where to get it)")
    return inner


def load_family(sd, info, kind: str, kw: dict):
    return LOADERS[require_family(sd, info.source, kind)](sd, info=info, **kw)
