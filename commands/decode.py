"""``python -m fastar decode``: saved codes (--tokens-out) or latents (--latents-out) back into images."""
from __future__ import annotations

import json
from pathlib import Path

from ..errors import FastARError
from .generate import save_images


def command_decode(args) -> int:
    import numpy as np
    import torch

    from ..model_loaders import load_image_decoder
    from ..pipeline import decode_images, resolve_device

    decoder = load_image_decoder(args.vq, device=resolve_device(args.device))
    if args.latents_in:
        try:
            inputs = torch.from_numpy(np.load(args.latents_in)).float()
        except (OSError, ValueError) as e:
            raise FastARError(f"{args.latents_in} is not a .npy array ({e}): give the file --latents-out wrote") from e
        want = "latents"
    else:
        try:
            saved = json.loads(Path(args.tokens_in).read_text())
            if "bits" in saved:  # Infinity: every scale's bits as integer labels, summed into f_hat by its VAE
                inputs = infinity_f_hat(decoder, saved, args)
            elif "scales" in saved:  # VAR: every scale's token map, joined in the scales' order
                scales = [tuple(s) for s in saved["scales"]]
                inputs = torch.tensor([sum(row, []) for row in saved["tokens"]], dtype=torch.long)
            else:
                scales = None
                inputs = torch.tensor(saved["tokens"], dtype=torch.long).view(-1, *saved["grid"])
        except (OSError, ValueError, KeyError, TypeError, RuntimeError, IndexError) as e:
            raise FastARError(f"{args.tokens_in} is not a tokens file ({type(e).__name__}: {e}): give the JSON "
                              "--tokens-out wrote") from e
        want = "f_hat" if "bits" in saved else "codes"
    if want == "codes":
        inputs = scale_codes_input(decoder, inputs, scales, args) if scales else inputs
        if scales is None and decoder.input_kind != "codes":
            raise FastARError(f"{args.vq} is {decoder.what}, which does not decode a raster model's codes: use the "
                              "model's VQ tokenizer for --tokens-in")
    if want != "f_hat":  # Infinity's f_hat was made by the VAE itself
        check_decoder_input(decoder, inputs)
    if want == "codes" and scales:
        inputs = decoder.codebook()[inputs]  # every scale's code vectors [B, L, C]: the VQVAE accumulates them
    save_images(decode_images(decoder, inputs), Path(args.out))
    return 0


def infinity_f_hat(decoder, saved: dict, args):
    """An Infinity tokens file's labels summed into f_hat by the BSQ VAE that is to decode them."""
    from ..model_loaders.infinity.labels import f_hat_of_labels

    if decoder.input_kind != "multi-scale-bits":
        raise FastARError(f"{args.tokens_in} holds an Infinity model's bits, but {args.vq} is {decoder.what}: use the "
                          "model's BSQ VAE for --vq")
    return f_hat_of_labels(decoder, saved["scales"], saved["tokens"], int(saved["bits"]), str(args.tokens_in),
                           saved.get("grid"))


def scale_codes_input(decoder, codes, scales, args):
    """A VAR tokens file's codes ``[B, L]``, checked against the multi-scale VQVAE that is to decode them."""
    if decoder.input_kind != "multi-scale":
        raise FastARError(f"{args.tokens_in} holds a VAR model's token maps of scales {[s[0] for s in scales]}, but "
                          f"{args.vq} is {decoder.what}: use the VAR's multi-scale VQVAE for --vq")
    if [tuple(s) for s in scales] != [(p, p) for p in decoder.cfg.patch_nums]:
        raise FastARError(f"{args.tokens_in} holds token maps of scales {[s[0] for s in scales]} but the VQVAE works "
                          f"over {list(decoder.cfg.patch_nums)}: use the VQVAE the model was trained with (or give it "
                          "the model's patch_nums in its NAME.json)")
    if codes.shape[1] != sum(p * p for p in decoder.cfg.patch_nums):
        raise FastARError(f"{args.tokens_in}: {codes.shape[1]} codes per image do not fill its scales: give the "
                          "JSON --tokens-out wrote")
    return codes


def check_decoder_input(decoder, inputs) -> None:
    if inputs.is_floating_point():  # latents: a KL autoencoder's, or code vectors for a VQ
        if inputs.dim() != 4 or inputs.shape[1] != decoder.cfg.embed_dim:
            raise FastARError(f"latents of shape {tuple(inputs.shape)}: {decoder.what} decodes [B, "
                              f"{decoder.cfg.embed_dim}, h, w]; pick the image decoder the model was trained with")
    elif int(inputs.max()) >= decoder.cfg.codebook_size or int(inputs.min()) < 0:
        raise FastARError(f"codes outside 0..{decoder.cfg.codebook_size - 1}: pick the VQ the model was trained with")
