"""VAR (next-scale prediction) and its multi-scale VQVAE (models.md, "VAR"): the release's math pinned on tiny
random models by formulas written out here, files in the release's layouts load, and the sampler follows the
release's scale-by-scale rules (per-scale guidance ramp, f_hat accumulation, area-downsampled next inputs)."""
import math
import subprocess
import sys

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from fastar.errors import FastARError
from fastar.model_loaders import load_ar_model, load_image_decoder
from fastar.model_loaders.shared.demo import DEMO_VQ
from fastar.model_loaders.shared.protocol import ClassConditioning
from fastar.model_loaders.var.model import VAR, VARConfig
from fastar.model_loaders.var.vqvae import MultiScaleVQVAE, VQVAEConfig, phi_index
from fastar.samplers.few_step_loops.next_scale import RecordedDraw, next_scale_decode, scale_sampling
from fastar.samplers.processing import SamplingSettings
from tiny_var import PATCH_NUMS, randomised, release_var_state_dict, release_vqvae_state_dict, tiny_var, tiny_vqvae

def test_scales_use_the_release_phi_convs():
    assert [phi_index(k, 10, 4) for k in range(10)] == [0, 0, 1, 1, 1, 2, 2, 3, 3, 3]
    assert [phi_index(k, 11, 4) for k in range(11)] == [0, 0, 0, 1, 1, 2, 2, 2, 3, 3, 3]
    assert [phi_index(k, 4, 2) for k in range(4)] == [0, 0, 1, 1]  # linspace(1/4, 3/4) for other counts


def reference_block(block, x, cond, mask):
    """One AdaLN block written out from the release's rules (independent of the module's forward)."""
    C, H = x.shape[-1], block.attn.heads
    mod = block.ada_lin[1](F.silu(cond))
    gamma1, gamma2, scale1, scale2, shift1, shift2 = (mod[:, i * C : (i + 1) * C][:, None] for i in range(6))
    ln = lambda t: F.layer_norm(t, (C,), eps=1e-6)  # noqa: E731
    a = ln(x) * (1 + scale1) + shift1
    qkv = a @ block.attn.mat_qkv.weight.T
    q, k, v = (qkv[..., i * C : (i + 1) * C] for i in range(3))
    q, v = q + block.attn.q_bias, v + block.attn.v_bias
    heads = lambda t: t.view(*t.shape[:2], H, C // H).transpose(1, 2)  # noqa: E731
    q, k, v = heads(q), heads(k), heads(v)
    cos = (q / q.norm(dim=-1, keepdim=True)) @ (k / k.norm(dim=-1, keepdim=True)).transpose(-1, -2)
    logits = cos * torch.exp(torch.clamp(block.attn.scale_mul_1H11, max=math.log(100)))
    attn = logits.masked_fill(~mask, float("-inf")).softmax(-1) @ v
    x = x + block.attn.proj(attn.transpose(1, 2).reshape(x.shape)) * gamma1
    f = ln(x) * (1 + scale2) + shift2
    return x + block.ffn.fc2(F.gelu(block.ffn.fc1(f), approximate="tanh")) * gamma2


def test_block_follows_the_release_math():
    model = tiny_var()
    block = model.blocks[0]
    with torch.no_grad():
        block.attn.scale_mul_1H11[0, 1] = 7.0  # above ln 100: the clamp must hold it there
        g = torch.Generator().manual_seed(0)
        x, cond = torch.randn(3, 30, 32, generator=g), torch.randn(3, 32, generator=g)
        mask = model.attn_bias_for_masking[0, 0] == 0
        # fp32 rounding of the cosines, times 100: about 3e-5 between two correct computations
        torch.testing.assert_close(block(x, cond, mask), reference_block(block, x, cond, mask), rtol=1e-3, atol=1e-4)


def test_mask_is_block_causal_by_scale():
    model = tiny_var()
    mask = model.attn_bias_for_masking[0, 0] == 0
    levels = model.lvl_1L[0]
    assert mask.shape == (30, 30) and levels.tolist() == [0] + [1] * 4 + [2] * 9 + [3] * 16
    assert mask[1, 4] and mask[4, 1] and not mask[4, 5] and mask[29, 0] and not mask[0, 1]


def test_teacher_forcing_equals_the_cached_scale_by_scale_session():
    model, vqvae = tiny_var(), tiny_vqvae()
    labels = torch.tensor([1, 3])
    codes = [torch.randint(0, 16, (2, p, p), generator=torch.Generator().manual_seed(p)) for p in PATCH_NUMS]
    inputs, _ = vqvae.teacher_inputs(codes, PATCH_NUMS)
    with torch.no_grad():
        full = model(labels, inputs)
        session = model.start(ClassConditioning(labels), cfg=True)
        bounds = model.cfg.scale_bounds()
        for scale, (begin, end) in enumerate(bounds):
            out = session.forward(scale, None if scale == 0 else inputs[:, begin - 1 : end - 1])
            torch.testing.assert_close(out.cond, full[:, begin:end], rtol=1e-4, atol=1e-5)
            null = model(torch.full_like(labels, 5), inputs)  # the null class is row num_classes
            torch.testing.assert_close(out.uncond, null[:, begin:end], rtol=1e-4, atol=1e-5)


def test_head_scales_before_it_shifts_and_the_first_slot_reads_the_class_twice():
    model = tiny_var()
    labels = torch.tensor([2])
    with torch.no_grad():
        cond = model.class_emb(labels)
        mod = model.head_nm.ada_lin[1](F.silu(cond))
        scale, shift = mod[:, :32], mod[:, 32:]
        x = cond[:, None] + model.pos_start + model.lvl_embed.weight[0] + model.pos_1LC[:, :1]
        for block in model.blocks:
            x = block(x, cond)
        expected = model.head(F.layer_norm(x, (32,), eps=1e-6) * (1 + scale) + shift)
        got = model.start(ClassConditioning(labels), cfg=False).forward(0).cond
        torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-5)


def test_f_hat_adds_each_scale_through_its_phi_and_the_next_input_is_area_downsampled():
    vqvae = tiny_vqvae()
    phis = vqvae.quantize.quant_resi.qresi_ls
    codes = [torch.randint(0, 16, (2, p, p), generator=torch.Generator().manual_seed(10 + p)) for p in PATCH_NUMS]
    with torch.no_grad():
        f_hat = torch.zeros(2, 4, 4, 4)
        expected_inputs = []
        for k, c in enumerate(codes):
            h = vqvae.quantize.embedding.weight[c].permute(0, 3, 1, 2)
            h = F.interpolate(h, size=(4, 4), mode="bicubic") if k < 3 else h
            phi = phis[phi_index(k, 4, 4)]
            f_hat = f_hat + 0.5 * h + 0.5 * F.conv2d(h, phi.weight, phi.bias, padding=1)
            if k < 3:
                n = PATCH_NUMS[k + 1]
                expected_inputs.append(F.adaptive_avg_pool2d(f_hat, n).flatten(2).transpose(1, 2))
        inputs, got = vqvae.teacher_inputs(codes, PATCH_NUMS)
    torch.testing.assert_close(got, f_hat, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(inputs, torch.cat(expected_inputs, dim=1), rtol=1e-5, atol=1e-5)


def test_encoding_by_scales_reproduces_its_own_f_hat_and_decodes():
    vqvae = tiny_vqvae()
    images = torch.rand(2, 3, 16, 16) * 2 - 1
    with torch.no_grad():
        codes = vqvae.encode_scales(images, PATCH_NUMS)
        _, f_hat = vqvae.teacher_inputs(codes, PATCH_NUMS)
        assert [tuple(c.shape) for c in codes] == [(2, p, p) for p in PATCH_NUMS]
        assert vqvae.decode(f_hat).shape == (2, 3, 16, 16)


def test_guidance_ramps_from_none_at_the_first_scale_to_cfg_at_the_last():
    base = SamplingSettings(cfg_scale=1.5, top_k=900, top_p=0.96)
    assert [scale_sampling(base, k, 4).cfg_scale for k in range(4)] == [1.0, 1.5, 2.0, 2.5]
    assert scale_sampling(base, 3, 4).top_k == 900 and scale_sampling(base, 3, 4).top_p == 0.96


def test_sampler_is_seeded_and_equals_the_ramped_pipeline_scale_by_scale():
    model, vqvae = tiny_var(), tiny_vqvae()
    conditioning = ClassConditioning(torch.tensor([0, 4]))
    sampling = SamplingSettings(cfg_scale=2.0, temperature=0.0)  # greedy: each scale is the argmax of its ramp
    f_hat, stats = next_scale_decode(model, vqvae, conditioning, sampling, generator=torch.Generator().manual_seed(0))
    assert stats.target_forwards == 4 and f_hat.shape == (2, 4, 4, 4)
    with torch.no_grad():
        session = model.start(conditioning, cfg=True)
        expected, inputs = torch.zeros(2, 4, 4, 4), None
        for k, p in enumerate(PATCH_NUMS):
            out = session.forward(k, inputs)
            t = 2.0 * k / 3
            codes = ((1 + t) * out.cond - t * out.uncond).argmax(-1).view(2, p, p)
            expected, inputs = vqvae.next_input(expected, codes, k, PATCH_NUMS)
    torch.testing.assert_close(f_hat, expected)
    seeded = SamplingSettings(cfg_scale=1.5, top_k=8, top_p=0.9)
    a, _ = next_scale_decode(model, vqvae, conditioning, seeded, generator=torch.Generator().manual_seed(3))
    b, _ = next_scale_decode(model, vqvae, conditioning, seeded, generator=torch.Generator().manual_seed(3))
    c, _ = next_scale_decode(model, vqvae, conditioning, seeded, generator=torch.Generator().manual_seed(4))
    assert torch.equal(a, b) and not torch.equal(a, c)


def test_release_layout_files_load(tmp_path):
    model, vqvae = tiny_var(), tiny_vqvae()
    (tmp_path / "var_tiny.json").write_text('{"patch_nums": [1, 2, 3, 4]}')
    torch.save(release_var_state_dict(model), tmp_path / "var_tiny.pth")
    sd = release_vqvae_state_dict(vqvae, 4)
    assert "decoder.mid.attn_1.qkv.weight" in sd and "decoder.mid.attn_1.q.weight" not in sd
    torch.save(sd, tmp_path / "vae_tiny.pth")
    (tmp_path / "vae_tiny.json").write_text('{"patch_nums": [1, 2, 3, 4]}')
    loaded = load_ar_model(tmp_path / "var_tiny.pth")
    decoder = load_image_decoder(tmp_path / "vae_tiny.pth")
    assert isinstance(loaded, VAR) and loaded.cfg.patch_nums == PATCH_NUMS and loaded.cfg.n_head == 2
    assert isinstance(decoder, MultiScaleVQVAE) and decoder.cfg.phis == 4 and decoder.cfg.with_encoder
    for a, b in ((model, loaded), (vqvae, decoder)):
        for (name, x), y in zip(a.state_dict().items(), b.state_dict().values()):
            torch.testing.assert_close(x, y, msg=name)
    without_buffers = {k: v for k, v in release_var_state_dict(model).items()
                       if k not in ("lvl_1L", "attn_bias_for_masking") and "zero_k_bias" not in k}
    torch.save(without_buffers, tmp_path / "var_tiny.pth")
    assert torch.equal(load_ar_model(tmp_path / "var_tiny.pth").attn_bias_for_masking, model.attn_bias_for_masking)


def test_a_var_file_of_unknown_scales_says_what_to_add_and_that_works(tmp_path):
    torch.save(release_var_state_dict(tiny_var()), tmp_path / "var_tiny.pth")
    (tmp_path / "config.json").write_text('{"patch_nums": [1, 2, 3, 4]}')  # not read beside a single file
    with pytest.raises(FastARError, match=r"put its patch_nums in var_tiny.json beside it \(e.g. "):
        load_ar_model(tmp_path / "var_tiny.pth")
    (tmp_path / "var_tiny.json").write_text('{"patch_nums": [1, 2, 5]}')
    with pytest.raises(FastARError, match=r"patch_nums \[1, 2, 5\] give 3 scales and 30 tokens but the weights have 4"):
        load_ar_model(tmp_path / "var_tiny.pth")
    (tmp_path / "var_tiny.json").write_text('{"patch_nums": [1, 2, 3, 4]}')  # the advice, followed
    assert load_ar_model(tmp_path / "var_tiny.pth").cfg.patch_nums == PATCH_NUMS


def test_a_vqvae_without_its_name_json_says_to_add_the_models_scales_and_that_works(tmp_path):
    """The VQVAE's weights do not show its scales: without its NAME.json it takes the release's, and the model's
    check says what to write where (even though it is the right VQVAE)."""
    from tiny_var import write_release_files

    write_release_files(tmp_path)
    (tmp_path / "vae_var_tiny.json").unlink()
    args = ("generate", "--model", tmp_path / "var_tiny.pth", "--vq", tmp_path / "vae_var_tiny.pth", "--classes", "1",
            "--quiet", "--latents-out", tmp_path / "f.npy")
    r = fastar(*args, cwd=tmp_path)
    assert r.returncode == 2 and 'write {"patch_nums": [1, 2, 3, 4]} into its NAME.json' in r.stderr
    assert "(vae_x.json for vae_x.pth)" in r.stderr
    (tmp_path / "vae_var_tiny.json").write_text('{"patch_nums": [1, 2, 3, 4]}')  # the advice, followed
    r = fastar(*args, cwd=tmp_path)
    assert r.returncode == 0, r.stderr


def fastar(*args, cwd):
    return subprocess.run([sys.executable, "-m", "fastar", *map(str, args)], cwd=cwd, capture_output=True,
                          text=True, timeout=600)


def test_cli_generates_with_the_release_sampler_and_refuses_raster_decoders(tmp_path):
    model, vqvae = tiny_var(), tiny_vqvae()
    (tmp_path / "var_tiny.json").write_text('{"patch_nums": [1, 2, 3, 4]}')
    torch.save(release_var_state_dict(model), tmp_path / "var_tiny.pth")
    torch.save(release_vqvae_state_dict(vqvae, 4), tmp_path / "vae_tiny.pth")
    (tmp_path / "vae_tiny.json").write_text('{"patch_nums": [1, 2, 3, 4]}')
    common = ("generate", "--model", tmp_path / "var_tiny.pth", "--vq", tmp_path / "vae_tiny.pth", "--classes", "1,4",
              "--quiet")
    r = fastar(*common, "--seed", 2, "--out", tmp_path / "a.png", "--latents-out", tmp_path / "a.npy", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert "ar: 2 images of 30 tokens in 4 forwards; " in r.stdout
    assert "(cfg 1.5 ramped over the scales, temperature 1, top-k 900, top-p 0.96)" in r.stdout
    assert (tmp_path / "a_1.png").exists() and np.load(tmp_path / "a.npy").shape == (2, 4, 4, 4)
    expected, _ = next_scale_decode(load_ar_model(tmp_path / "var_tiny.pth"), load_image_decoder(tmp_path / "vae_tiny.pth"),
                                    ClassConditioning(torch.tensor([1, 4])), SamplingSettings(1.5, 1.0, 900, 0.96),
                                    generator=torch.Generator().manual_seed(2))
    np.testing.assert_allclose(np.load(tmp_path / "a.npy"), expected.numpy(), rtol=1e-5, atol=1e-5)
    r = fastar(*common, "--seed", 2, "--compile", "on", "--out", tmp_path / "c.png", cwd=tmp_path)
    assert r.returncode == 0 and " s of it compiling steps)" in r.stdout, r.stderr  # apart from the sampling time
    r = fastar(*common, "--decoder", "sjd", cwd=tmp_path)
    assert r.returncode == 2 and "sjd needs a token model (LlamaGen); this is a VAR model (next-scale prediction): " \
        "use one of ar, fm with it" in r.stderr
    r = fastar(*common[:3], "--vq", DEMO_VQ, "--classes", "1", cwd=tmp_path)
    assert r.returncode == 2 and "its image decoder is its multi-scale VQVAE" in r.stderr


def test_top_k_0_and_top_p_1_are_off_and_tokens_out_writes_every_scale_which_decode_reads(tmp_path):
    """Absent flags take the release's top-k 900 / top-p 0.96 (above); given as 0 and 1 they are off. --tokens-out
    writes each scale's token map, the codes the sampler drew, and decode --tokens-in turns it into the same image."""
    import json

    from tiny_var import write_release_files

    write_release_files(tmp_path)
    common = ("generate", "--model", tmp_path / "var_tiny.pth", "--vq", tmp_path / "vae_var_tiny.pth", "--classes",
              "1,4", "--quiet", "--seed", 3)
    r = fastar(*common, "--top-k", 0, "--top-p", 1, "--tokens-out", tmp_path / "t.json", "--out", tmp_path / "a.png",
               cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert "cfg 1.5 ramped over the scales, temperature 1, top-k 0, top-p 1.0" in r.stdout
    drawn = []
    next_scale_decode(load_ar_model(tmp_path / "var_tiny.pth"), load_image_decoder(tmp_path / "vae_var_tiny.pth"),
                      ClassConditioning(torch.tensor([1, 4])), SamplingSettings(1.5, 1.0, 0, 1.0),
                      generator=torch.Generator().manual_seed(3), scale_codes=drawn)
    saved = json.loads((tmp_path / "t.json").read_text())
    assert saved["scales"] == [[1, 1], [2, 2], [3, 3], [4, 4]] and saved["grid"] == [4, 4]
    assert saved["tokens"] == [[scale[row].flatten().tolist() for scale in drawn] for row in range(2)]
    r = fastar("decode", "--vq", tmp_path / "vae_var_tiny.pth", "--tokens-in", tmp_path / "t.json", "--out",
               tmp_path / "b.png", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    from PIL import Image

    for i in range(2):
        a, b = (np.asarray(Image.open(tmp_path / f"{n}_{i}.png"), dtype=np.int16) for n in "ab")
        assert np.abs(a - b).max() <= 1
    r = fastar("decode", "--vq", DEMO_VQ, "--tokens-in", tmp_path / "t.json", "--out", tmp_path / "c.png", cwd=tmp_path)
    assert r.returncode == 2 and "use the VAR's multi-scale VQVAE for --vq" in r.stderr


def test_cfg_help_says_how_each_family_turns_guidance_off():
    r = fastar("generate", "--help", cwd=".")
    text = " ".join(r.stdout.split())
    assert "Token models and MAR: 1 = off, default 2.0 (the bundled MAR demo's own: 3; Emu3: the release's 3); VAR: " \
        "ramped from none at the first scale to --cfg at the last (1 still guides), 0 = off, default the release's " \
        "1.5; Infinity: the same at every scale, 1 = off, default the release's 3" in text
    assert "for VAR the release's 900 (Infinity's too), for Emu3 the release's 2048 (give 0 to turn it off)" in text
    assert "for VAR the release's 0.96 (the bundled VAR demo's own: 0.7; Infinity's 0.97; give 1 to turn it off)" \
        in text
    assert "Infinity's tau, 0.5 for the 2B and 1 for the 8B" in text
    at_one = scale_sampling(SamplingSettings(cfg_scale=1.0), 3, 4)
    assert at_one.cfg_scale == 2.0 and at_one.use_cfg  # VAR at --cfg 1 still guides at the last scale
    assert not scale_sampling(SamplingSettings(cfg_scale=0.0), 3, 4).use_cfg


def test_fm_on_a_var_samples_the_exact_joint_of_its_scales():
    """Two scales (1 + 4 tokens), three codes: the exact joint is p(scale 0) times the product of scale 1's
    per-token distributions given it; the flow map of each token's noise must sample it (TV under the null
    99.9% bound at 20000 rows), and a broken map (the seed's sign typo) must not."""
    from fastar.samplers.few_step_loops import flow_map as fm
    from fastar.samplers.processing import probabilities
    from test_flow_map import null_tv_bound, seed_equation_3, tv_distance

    cfg = VARConfig(depth=1, dim=32, n_head=2, vocab_size=3, channels=4, num_classes=2, patch_nums=(1, 2))
    model = randomised(VAR(cfg), 7, 0.1)  # logits of about unit scale: a spread-out joint
    vqvae = randomised(MultiScaleVQVAE(VQVAEConfig(codebook_size=3, embed_dim=4, z_channels=4, ch=32, ch_mult=(1, 2),
                                                   num_res_blocks=1, encoder_attn_levels=(), decoder_attn_levels=(),
                                                   patch_nums=(1, 2))), 8, 0.5)
    sampling = SamplingSettings(cfg_scale=1.5, temperature=1.3, top_p=0.9)
    with torch.no_grad():  # the exact joint over (c0, c1, c2, c3, c4), c0 the most significant digit
        session = model.start(ClassConditioning(torch.ones(3, dtype=torch.long)), cfg=True)
        first = probabilities(session.forward(0), scale_sampling(sampling, 0, 2))[0, 0]
        _, inputs = vqvae.next_input(torch.zeros(3, 4, 2, 2), torch.arange(3).view(3, 1, 1), 0, (1, 2))
        second = probabilities(session.forward(1, inputs), scale_sampling(sampling, 1, 2))  # [3, 4, V]
    exact = torch.einsum("a,ab,ac,ad,ae->abcde", first, *second.unbind(1)).flatten().numpy()
    assert (exact > 1e-3).sum() > 30  # a joint worth testing

    def tv_of_fm(monkey=None) -> float:
        rows = 20000
        noise = torch.randn(rows, 5, 4, generator=torch.Generator().manual_seed(0))
        draw = RecordedDraw(fm.NoiseToCode(noise, vqvae.codebook().float()).span)
        next_scale_decode(model, vqvae, ClassConditioning(torch.ones(rows, dtype=torch.long)), sampling,
                          generator=None, draw=draw)
        codes = draw.codes
        index = (codes * torch.tensor([81, 27, 9, 3, 1])).sum(1)
        return tv_distance(np.bincount(index.numpy(), minlength=243).astype(float), exact)

    bound = null_tv_bound(exact, 20000)
    assert tv_of_fm() < bound
    original = fm.expected_code
    fm.expected_code = seed_equation_3
    try:
        assert tv_of_fm() > bound
    finally:
        fm.expected_code = original


def demo_var_pair():
    from fastar.model_loaders.shared.demo import DEMO_VAR, DEMO_VAR_VQVAE

    return load_ar_model(DEMO_VAR), load_image_decoder(DEMO_VAR_VQVAE)


@pytest.mark.parametrize("decoder", ["ar", "fm"])
def test_compiled_scale_steps_give_eagers_image_and_compile_each_scale_once(decoder):
    """compile on: each scale's forward through torch.compile (a graph per scale, none more for the next image)
    draws eager's very f_hat on the trained demo VAR: sampled with its guidance ramp at temperature 0.9, top-k and
    top-p, batch 2, and by the flow map; a VAR does not compile under auto (no gain on the CPU, CUDA not compared)."""
    from fastar.model_loaders.shared.compiled import compile_steps, compiled_mode, unique_graphs
    from fastar.samplers.decoders import decode_next_scale

    model, vqvae = demo_var_pair()
    assert compiled_mode(compile_steps(model, "auto")) is None
    rows = ClassConditioning(torch.tensor([1, 6]))
    sampling = SamplingSettings(cfg_scale=1.5, temperature=0.9, top_k=100, top_p=0.95)
    run = lambda seed: decode_next_scale(model, rows, sampling, seed=seed, vqvae=vqvae, decoder=decoder)  # noqa: E731
    eager = [run(seed)[0] for seed in (0, 1)]
    compile_steps(model, "on")
    graphs = unique_graphs()
    first, _ = run(0)
    compiled = unique_graphs()
    assert compiled - graphs <= len(model.cfg.patch_nums)  # fewer where an earlier test compiled them
    second, stats = run(1)
    assert unique_graphs() == compiled and stats.compile_time_s == 0
    assert torch.equal(first, eager[0]) and torch.equal(second, eager[1]) and not torch.equal(eager[0], eager[1])


def test_cuda_graph_scale_steps_keep_their_caches_between_images():
    """Mode reduce-overhead (CUDA graphs): a session's per-block key and value caches are the model's static buffers,
    the same addresses for the next image; f_hat as eager's."""
    from fastar.model_loaders.shared.compiled import compile_steps
    from fastar.samplers.decoders import decode_next_scale

    eager, vqvae = tiny_var(), tiny_vqvae()
    model = compile_steps(tiny_var(), "on", mode="reduce-overhead")
    rows, sampling = ClassConditioning(torch.tensor([0, 4])), SamplingSettings(cfg_scale=1.5, top_k=8)
    addresses = []
    for seed in (0, 1):
        got = decode_next_scale(model, rows, sampling, seed=seed, vqvae=vqvae)[0]
        assert torch.equal(got, decode_next_scale(eager, rows, sampling, seed=seed, vqvae=vqvae)[0])
        addresses.append([b.data_ptr() for b in model.static_buffers.buffers])
    assert addresses[0] == addresses[1] and len(addresses[0]) == 2 * len(model.blocks)
    assert model.static_buffers.buffers[0].shape == (4, 2, 30, 16)  # 2 rows and their CFG rows, 2 heads, 30 slots
