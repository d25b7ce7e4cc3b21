"""LANTERN's EAGLE drafter for Anole (Chameleon family) against a reference built from transformers'
ChameleonDecoderLayer: the drafter's rows (target hidden at slot t with the token at slot t+1, fc, one
Chameleon layer at the sequence positions) for cond rows with prompts of different lengths and CFG's
uncond rows, fed by the target's windows as spec decoding feeds them and by its own features (EAGLE's
recursion); then whole runs through the command line and the refusals of drafters of another family.
"""
import json
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from fastar.errors import FastARError
from fastar.model_loaders import load_ar_model
from fastar.model_loaders.shared.demo import DEMO_AR, DEMO_DRAFTER
from fastar.model_loaders.drafters.loader import load_drafter, save_eagle_drafter
from fastar.model_loaders.shared.protocol import PromptConditioning
from fastar.tests.tiny_chameleon import CODES, hf_model, write_anole_drafter, write_folder

PROMPTS = ["a red ring on a blue background", "a green square"]


@pytest.fixture(scope="module")
def reference():
    return hf_model(seed=0)


@pytest.fixture(scope="module")
def folders(reference, tmp_path_factory):
    root = tmp_path_factory.mktemp("anole")
    return (write_folder(root / "tiny-anole", reference, lumina=False, image_size=None),
            write_folder(root / "tiny-lumina", reference, lumina=True))


@pytest.fixture(scope="module")
def drafter_files(reference, tmp_path_factory):
    folder = tmp_path_factory.mktemp("drafter") / "anole_drafter"
    return (folder, *write_anole_drafter(folder, reference, seed=7))


@torch.no_grad()
def reference_drafter_logits(reference, model, drafter_files, seq: list[int], replace: dict[int, int] | None = None):
    """[T-1, CODES]: the reference drafter's image logits of every row of the whole sequence ``seq``; row t
    reads the target's hidden at t, or (``replace`` {t: s}) the drafter's own feature of row s."""
    _, weights, layer, rotary = drafter_files
    ids = torch.tensor([seq])
    hidden = reference.model(ids).last_hidden_state[0]  # after the final norm
    T = len(seq) - 1
    embedded = weights["embed_tokens.weight"][ids[0, 1:]]
    mask = torch.full((T, T), float("-inf")).triu(1)[None, None]
    positions = torch.arange(T)[None]

    def rows(h):
        x = torch.cat([embedded, h[:T]], -1) @ weights["fc.weight"].T + weights["fc.bias"]
        out = layer(x[None], attention_mask=mask, position_ids=positions,
                    position_embeddings=rotary(x[None], positions))
        return (out[0] if isinstance(out, tuple) else out)[0]

    features = rows(hidden)
    for t, s in (replace or {}).items():  # causal: rows before t are unchanged by the replacement
        hidden = hidden.clone()
        hidden[t] = features[s]
        features = rows(hidden)
    return reference.lm_head(features)[:, model.cfg.image_ids]


def test_the_drafter_reads_the_targets_windows_as_the_reference_does(reference, folders, drafter_files):
    model = load_ar_model(folders[0])
    drafter = load_drafter(drafter_files[0], model)
    assert type(drafter).__name__ == "LayoutEagleDrafter" and drafter.needs_target_hidden
    N = model.grid[0] * model.grid[1]
    codes = torch.randint(0, CODES, (2, N), generator=torch.Generator().manual_seed(3))
    conditioning = PromptConditioning(PROMPTS)
    prompts = model.prompts.encode(conditioning)
    assert len(prompts[0]) != len(prompts[1])  # left padding is exercised
    session = model.start(conditioning, cfg=True, max_window=4, hidden=True)
    drafting = drafter.start(conditioning, cfg=True, max_window=4, target_session=session)

    prefixes = {("cond", b): prompts[b] + model.cfg.image_prefix for b in range(2)}
    prefixes.update({("uncond", b): list(model.cfg.uncond_prefix) for b in range(2)})
    image = [model.cfg.image_ids[c] for c in codes.tolist()[0]], [model.cfg.image_ids[c] for c in codes.tolist()[1]]
    expected = {key: reference_drafter_logits(reference, model, drafter_files, prefix + image[key[1]])
                for key, prefix in prefixes.items()}

    def check(out, predicts, expected_of):
        for kind, logits in (("cond", out.cond), ("uncond", out.uncond)):
            for b in range(2):
                want = expected_of((kind, b))[len(prefixes[(kind, b)]) + int(predicts[b]) - 2]
                assert torch.allclose(logits[b, 0], want, atol=3e-5, rtol=1e-4), (kind, b, int(predicts[b]))

    # spec decoding's calls: catch up on the target's last window, then draft on the drafter's own features
    last_out, last_start, n = session.first, torch.tensor([-1, -1]), torch.tensor([1, 1])
    for width, advance in ((1, (1, 1)), (3, (2, 1)), (4, (3, 2)), (2, (1, 1))):
        out = drafting.catch_up(codes, n, last_out, last_start)
        check(out, n, lambda key: expected[key])  # token n from the target's hidden states
        recursion = drafting.step(codes.gather(1, n[:, None]), n)  # token n+1 from the drafter's feature of token n
        for kind, logits in (("cond", recursion.cond), ("uncond", recursion.uncond)):
            for b in range(2):
                row = len(prefixes[(kind, b)]) + int(n[b]) - 1  # the row reading token n
                seq = prefixes[(kind, b)] + image[b]
                want = reference_drafter_logits(reference, model, drafter_files, seq, {row: row - 1})[row]
                assert torch.allclose(logits[b, 0], want, atol=3e-5, rtol=1e-4), (kind, b)
        window = torch.stack([codes[b, int(n[b]) - 1: int(n[b]) - 1 + width] for b in range(2)])
        last_out, last_start = session.forward(window, n - 1), n - 1
        n = n + torch.tensor(advance)


def test_a_saved_drafter_is_in_the_release_layout_and_loads_back(folders, drafter_files, tmp_path):
    """FastAR runs the layer's q, k, v (and gate, up) as one matmul: a saved drafter still has them apart."""
    model = load_ar_model(folders[0])
    drafter = load_drafter(drafter_files[0], model)
    save_eagle_drafter(drafter, tmp_path / "saved")
    weights, saved = drafter_files[1], load_file(str(tmp_path / "saved" / "model.safetensors"))
    assert saved.keys() == weights.keys() and "layers.0.self_attn.k_proj.weight" in saved
    assert all(torch.equal(saved[k], weights[k].half()) for k in weights)
    again = load_drafter(tmp_path / "saved", model)  # as the Anole drafter it was, not as a LlamaGen one
    assert type(again).__name__ == "LayoutEagleDrafter" and again.head.cfg == drafter.head.cfg


def test_spec_and_lantern_with_the_drafter_run_from_the_command_line(folders, drafter_files, tmp_path):
    from fastar.model_loaders.chameleon.vqgan import VQGAN
    from fastar.model_loaders.shared.ldm_blocks import VQGANConfig

    vqgan = tmp_path / "vqgan.ckpt"
    torch.manual_seed(0)
    torch.save({"state_dict": VQGAN(VQGANConfig(codebook_size=CODES, embed_dim=8, z_channels=32, ch=32,
                                                ch_mult=(1, 2), num_res_blocks=1)).state_dict()}, vqgan)

    def generate(decoder, *extra):
        stats = tmp_path / f"{decoder}.json"
        r = subprocess.run([sys.executable, "-m", "fastar", "generate", "--model", str(folders[0]), "--vq", str(vqgan),
                            "--prompt", "a red ring", "--prompt", "a green square", "--cfg", "3", "--decoder", decoder,
                            "--temperature", "0", "--tokens-out", str(tmp_path / f"{decoder}_tokens.json"),
                            "--stats-out", str(stats), "--out", str(tmp_path / f"{decoder}.png"), *extra],
                           capture_output=True, text=True, timeout=600)
        assert r.returncode == 0, r.stderr
        return json.loads((tmp_path / f"{decoder}_tokens.json").read_text()), json.loads(stats.read_text())

    plain, _ = generate("ar")
    spec, stats = generate("spec", "--drafter", str(drafter_files[0]), "--gamma", "4")
    assert spec == plain  # greedy: verification keeps the target's choice whatever the drafter proposed
    assert stats["drafter_forwards"] > 0 and stats["target_forwards"] < 1024
    _, stats = generate("lantern", "--drafter", str(drafter_files[0]))
    assert stats["decoder"] == "lantern" and stats["drafter_forwards"] > 0


def test_drafters_of_another_family_or_layout_are_refused(folders, drafter_files):
    anole, lumina = (load_ar_model(f) for f in folders)
    with pytest.raises(FastARError, match="trained for a layout without row-end tokens, and .* has row-end tokens"):
        load_drafter(drafter_files[0], lumina)
    with pytest.raises(FastARError, match="EAGLE drafter for LlamaGen models; the target is an Anole"):
        load_drafter(DEMO_DRAFTER, anole)
    with pytest.raises(FastARError, match="EAGLE drafter for Chameleon-family models .*the target is a LlamaGen GPT"):
        load_drafter(drafter_files[0], load_ar_model(DEMO_AR))
    with pytest.raises(FastARError, match="small-model drafters serve LlamaGen targets"):
        load_drafter(DEMO_AR, anole)


def test_compiled_steps_give_eagers_tokens_with_the_drafter(folders, drafter_files, monkeypatch):
    """Sampled spec with the Anole drafter (its layout's rows, RoPE and image-token ids) and the target's steps
    compiled: the drafter's steps and every loop step compile alongside (samplers/token_loops/loop_step.py), same tokens."""
    from fastar.model_loaders.drafters.eagle import EagleSession
    from fastar.model_loaders.shared.compiled import compile_steps, compiled_function
    from fastar.samplers.decoders import DecoderSpec, decode
    from fastar.samplers.processing import SamplingSettings

    eager, compiled = load_ar_model(folders[0]), compile_steps(load_ar_model(folders[0]))
    sampling, spec = SamplingSettings(cfg_scale=3.0, temperature=0.8, top_k=50), DecoderSpec("spec", gamma=3)
    conditioning = PromptConditioning(PROMPTS)
    stepped, calls = compiled_function(EagleSession.stepped, "default"), []
    real = stepped.compiled
    monkeypatch.setattr(stepped, "compiled", lambda *args, **kwargs: calls.append(1) or real(*args, **kwargs))
    want, _ = decode(eager, conditioning, sampling, spec, seed=4, drafter=load_drafter(drafter_files[0], eager))
    got, _ = decode(compiled, conditioning, sampling, spec, seed=4, drafter=load_drafter(drafter_files[0], compiled))
    assert torch.equal(got, want)
    assert calls and stepped.failure is None  # the drafter's steps ran compiled
