"""Model families: architectures and checkpoint readers. The front doors pick the loader from the keys."""
from ..errors import FastARError
from ..torch_version import check_torch_version
from .chameleon.loader import load_chameleon, load_vqgan
from .shared.checkpoint import (AR_MODEL, FAMILY_WHAT, IMAGE_DECODER, detect_family, read_state_dict, require_family,
                                select)
from .dd.loader import load_dd_student
from .emu3.loader import load_emu3
from .emu3.vqvae import load_emu3_vq
from .infinity.loader import load_infinity
from .infinity.vae import load_infinity_vae
from .janus.loader import load_janus, vq_of_janus
from .llamagen.loader import load_llamagen, load_vq
from .mar.loader import load_kl_vae, load_mar
from .shared.quantized import format_to_load, quantised_loading
from .shared.streaming import make_streamable
from .var.loader import load_var, load_var_dd, load_var_vqvae

LOADERS = {"llamagen-dd": load_dd_student, "llamagen-gpt": load_llamagen, "llamagen-gpt-hf": load_llamagen,
           "mar": load_mar, "chameleon": load_chameleon, "janus": load_janus, "emu3": load_emu3, "var": load_var,
           "var-dd": load_var_dd, "var-vqvae": load_var_vqvae, "infinity": load_infinity,
           "llamagen-vq": load_vq, "kl-vae": load_kl_vae, "chameleon-vqgan": load_vqgan, "emu3-vq": load_emu3_vq,
           "infinity-vae": load_infinity_vae}


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
    # what the front ends take where the user gives no value: the file's own (FastAR's models), else the release's
    model.defaults = {**getattr(model, "release_defaults", {}), **info.fastar_defaults()}
    return model


def load_image_decoder(path, **kw):
    """The image decoder (VQ tokenizer, KL autoencoder, VQGAN) in a checkpoint file or folder; a model folder
    whose weights include its VQ model (``model.vqmodel.*``, Emu3's ``vqmodel.*``) gives that."""
    sd, info = read_state_dict(path)
    sd = embedded_image_decoder(sd, info)
    return LOADERS[require_family(sd, info.source, IMAGE_DECODER)](sd, info=info, **kw)


EMBEDDED_VQ = ("model.vqmodel.", "vqmodel.")  # transformers' module path; its saved Emu3 folders


def embedded_image_decoder(sd: dict, info) -> dict:
    """The VQ model inside a model folder (Janus's ``gen_vision_model.*``, converted ``model.vqmodel.*``, Emu3's
    ``vqmodel.*``), renamed as a VQ file has it; other state dicts as they are."""
    if detect_family(sd) == "janus":
        return vq_of_janus(sd, converted=EMBEDDED_VQ[0] + "decoder.conv_in.weight" in sd)
    prefix = next((p for p in EMBEDDED_VQ if any(k.startswith(p) for k in sd)), None)
    if prefix is None:
        return sd
    inner = select(sd, {k[len(prefix):]: k for k in sd if k.startswith(prefix)})
    if not any(k.startswith("decoder.") for k in inner):
        raise FastARError(f"{info.source} carries its VQ model without the decoder (transformers' Chameleon conversion "
                          "keeps only the encoder): load Meta's vqgan.ckpt (Chameleon's release, with vqgan.yaml) "
                          "as the image decoder (FastAR's docs/models.md says where to get it)")
    return inner


SHAPED = ("emu3", "chameleon", "infinity")  # the families that draw other shapes than squares (an aspect ratio;
# Lumina-mGPT does, Anole refuses one)


def load_family(sd, info, kind: str, kw: dict):
    family = require_family(sd, info.source, kind)
    if family not in SHAPED and kw.get("aspect_ratio") is not None:
        raise FastARError(f"{info.source} is {FAMILY_WHAT[family]}, which draws square images: leave the aspect ratio "
                          "out (Emu3, Lumina-mGPT and Infinity models take one)")
    kw = kw if family in SHAPED else {k: v for k, v in kw.items() if k != "aspect_ratio"}
    return LOADERS[family](sd, info=info, **kw)
