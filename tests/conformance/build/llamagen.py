"""Builds the LlamaGen-family conformance fixtures with the official code (run by hand, never by the tests).

    python tests/conformance/build/llamagen.py c2i     --official CHECKOUT_OF_FoundationVision/LlamaGen
    python tests/conformance/build/llamagen.py t2i     --official CHECKOUT_OF_FoundationVision/LlamaGen
    python tests/conformance/build/llamagen.py dd      --official CHECKOUT_OF_microsoft/distilled_decoding
    python tests/conformance/build/llamagen.py lantern --official CHECKOUT_OF_jadohu/LANTERN
                                                       --llamagen CHECKOUT_OF_FoundationVision/LlamaGen
    python tests/conformance/build/llamagen.py lantern_t2i --official CHECKOUT_OF_jadohu/LANTERN
    python tests/conformance/build/llamagen.py zipar   --official CHECKOUT_OF_ThisisBillhe/ZipAR
    python tests/conformance/build/llamagen.py lantern_trees --official CHECKOUT_OF_jadohu/LANTERN
                                                       --llamagen CHECKOUT_OF_FoundationVision/LlamaGen
    python tests/conformance/build/llamagen.py lantern_t2i_trees --official CHECKOUT_OF_jadohu/LANTERN

c2i, dd and zipar need only torch (FastAR's venv will do). t2i, lantern and lantern_t2i need the official code's transformers
(4.45.2; transformers 5 changes the configs LANTERN reads) plus, for t2i, T5Embedder's ftfy, beautifulsoup4 and
accelerate: a throwaway venv outside the repository, e.g. torch from FastAR's venv through a .pth file and
`pip install transformers==4.45.2 ftfy beautifulsoup4 accelerate==1.1.1`. lantern_t2i runs LANTERN's own LlamaGen
target class (models/kv_variants/modeling_llamagen_kv.py, the converted LlamaGen-T2I layout) and its sampler
(ea_model_llamagen.EaModel) with the tiny T5 folder of llamagen_t2i/; its departures are in its expected.json.
lantern_trees and lantern_t2i_trees keep the committed weights of llamagen_lantern/ and llamagen_t2i_lantern/ and add
expected_trees.json beside expected.json: LANTERN's static (naive_extend_57) and dynamic (EAGLE-2) trees at its
defaults, greedy, with the checks of build/trees.py (same venv as lantern_t2i).
A checkout without .git takes its commit from --commit / --llamagen-commit.

Each case builds a tiny model with the official classes, saves it as the official save path does, runs the
official sampler (greedy: top-k 1) and the official decoder, and writes fixtures/<case>/ (weights, expected.json,
PNGs). Everything runs on a CPU. The tiny VQ tokenizer (made with the official VQ classes) lives in
fixtures/llamagen_c2i/vq.pt and is shared by the other cases.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
from common import FIXTURES, save_image  # noqa: E402
from provenance import COMMITS, commit_of, fixed_at_of, packages, stub_torchvision, write_expected  # noqa: E402
import trees  # noqa: E402 - build/trees.py: LANTERN's trees and the checks of a tree fixture

# the tiny sizes: GPT width 32, 2 layers, 2 heads, a 64-code VQ with 2 levels
# (downsample 2), 6x6 image tokens (12x12 px images)
VOCAB = 64
GRID = 6
DOWNSAMPLE = 2
DIM, LAYERS, HEADS, KV_HEADS = 32, 2, 2, None  # the official KVCache holds n_head heads: no GQA in generate()
NUM_CLASSES = 10
CLASSES = [3, 7]
CFG = 4.0
SEED = 0


def official_path(checkout: Path) -> None:
    sys.path.insert(0, str(checkout))


class MarginRecorder:
    """Wraps the official ``sample`` of generate.py: records the gap between the two largest (CFG-combined)
    logits at each step, so a greedy fixture never rests on a near tie that float order could flip."""

    def __init__(self, module):
        self.module, self.original, self.gaps = module, module.sample, []

    def __enter__(self):
        def sample(logits, *args, **kwargs):
            top = logits[:, -1, :].float().topk(2, dim=-1).values
            self.gaps.append((top[:, 0] - top[:, 1]).min().item())
            return self.original(logits, *args, **kwargs)
        self.module.sample = sample
        return self

    def __exit__(self, *exc):
        self.module.sample = self.original

    def check(self, least=1e-3):
        worst = min(self.gaps)
        assert worst > least, f"a greedy step has a near tie (top-2 logit gap {worst:.2e}): change the seed"


def reinit_head(linear: torch.nn.Linear, std: float) -> None:
    """The official output head is zero-initialised (constant logits): give it random weights."""
    torch.nn.init.normal_(linear.weight, std=std)


def check_codes(codes: torch.Tensor, least: int = 10) -> None:
    for row in codes:
        distinct = len(set(row.tolist()))
        assert distinct >= least, f"greedy codes use only {distinct} distinct values: {row.tolist()}"


# -- the VQ tokenizer ---------------------------------------------------------------------------------


def build_vq(vq_model):
    """The smallest VQ the official classes allow: the official VQModel (its ModelArgs with 2 levels, a 64-code
    codebook, z_channels 32, no usage buffer), with its encoder and decoder swapped for the official Encoder and
    Decoder classes at ch=32 (VQModel hard-codes ch=128) and one residual block per decoder level."""
    torch.manual_seed(SEED)
    vq = vq_model.VQModel(vq_model.ModelArgs(
        codebook_size=VOCAB, codebook_embed_dim=8, codebook_show_usage=False,
        encoder_ch_mult=[1, 1], decoder_ch_mult=[1, 1], z_channels=32))
    vq.encoder = vq_model.Encoder(ch=32, ch_mult=(1, 1), num_res_blocks=0, z_channels=32)
    vq.decoder = vq_model.Decoder(z_channels=32, ch=32, ch_mult=(1, 1), num_res_blocks=0)
    # GroupNorm affine params start at 1/0: vary them so a norm applied in the wrong place shows
    for module in vq.modules():
        if isinstance(module, torch.nn.GroupNorm):
            torch.nn.init.normal_(module.weight, 1.0, 0.2)
            torch.nn.init.normal_(module.bias, 0.0, 0.2)
    # the official init stores unit rows; trained codebooks do not: scale the rows so the lookup's
    # L2 normalisation matters
    vq.quantize.embedding.weight.mul_(torch.rand(VOCAB, 1) * 1.5 + 0.5)
    return vq.eval()


def official_decode(vq, codes: torch.Tensor, folder: Path, prefix: str) -> list[str]:
    """The official decode_code() images of ``codes`` [B, N], saved as PNGs; their file names."""
    with torch.no_grad():
        images = vq.decode_code(codes, [codes.shape[0], 8, GRID, GRID])
    assert 0.05 < (images.abs() < 1).float().mean() and images.std() > 0.1, "degenerate official image"
    names = []
    for i, image in enumerate(images):
        names.append(f"{prefix}_{i}.png")
        save_image(image.numpy(), folder / names[-1])
    return names


# -- case 1: class-to-image -------------------------------------------------------------------------


def train_c2i_args(**overrides) -> argparse.Namespace:
    """The argparse.Namespace that autoregressive/train/train_c2i.py saves as checkpoint["args"]: its parser's
    defaults, with the tiny model's values where they differ."""
    args = dict(
        code_path="codes", cloud_save_path="ckpt", no_local_save=False, gpt_model="GPT-B", gpt_ckpt=None,
        gpt_type="c2i", vocab_size=16384, ema=False, cls_token_num=1, dropout_p=0.1, token_dropout_p=0.1,
        drop_path_rate=0.0, no_compile=False, results_dir="results", dataset="imagenet_code", image_size=256,
        downsample_size=16, num_classes=1000, epochs=300, lr=1e-4, weight_decay=5e-2, beta1=0.9, beta2=0.95,
        max_grad_norm=1.0, global_batch_size=256, global_seed=0, num_workers=24, log_every=100,
        ckpt_every=5000, gradient_accumulation_steps=1, mixed_precision="bf16",
    )
    args.update(overrides)
    return argparse.Namespace(**args)


def tiny_gpt(gpt, seed=SEED, grid=GRID, **kwargs):
    torch.manual_seed(seed)
    model = gpt.Transformer(gpt.ModelArgs(
        dim=DIM, n_layer=LAYERS, n_head=HEADS, n_kv_head=KV_HEADS, multiple_of=32, vocab_size=VOCAB,
        block_size=grid * grid, **kwargs))
    reinit_head(model.output, std=DIM ** -0.5 * 3)
    # the official init (std 0.02) makes a tiny model's next code a function of the last code alone (greedy
    # codes then cycle): larger weights, spread embeddings and norms so position and context matter
    for module in model.layers.modules():
        if isinstance(module, torch.nn.Linear):
            torch.nn.init.normal_(module.weight, std=module.in_features ** -0.5)
    torch.nn.init.normal_(model.tok_embeddings.weight, std=1.0)
    for module in model.modules():
        if isinstance(module, gpt.RMSNorm):
            torch.nn.init.normal_(module.weight, 1.0, 0.2)
    return model.eval()


def official_greedy(generate_module, model, cond, grid=GRID, **kwargs) -> torch.Tensor:
    with MarginRecorder(generate_module) as margins:
        codes = generate_module.generate(model, cond, grid * grid, cfg_scale=CFG, cfg_interval=-1,
                                         temperature=1.0, top_k=1, top_p=1.0, sample_logits=True, **kwargs)
    margins.check()
    check_codes(codes)
    return codes


def first_good_seed(make, run, tries=20) -> int:
    """The first weight seed whose greedy codes vary (a tiny random model often locks onto one code) without
    near ties."""
    for seed in range(tries):
        try:
            run(make(seed))
            return seed
        except AssertionError as e:
            print(f"seed {seed}: {e}")
    raise SystemExit("no seed gave varied greedy codes")


def save_c2i_and_reload(make, seed: int, folder: Path):
    """The tiny c2i GPT of weight seed ``seed`` saved as train_c2i.py saves it (gpt.pt, plus gpt.json: no official
    size has these shapes, so the head count goes where FastAR reads it for a custom size), and the same file
    loaded into a fresh model, as sample_c2i.py loads it, for the official sampler to run on."""
    args = train_c2i_args(gpt_model="GPT-tiny", vocab_size=VOCAB, image_size=GRID * DOWNSAMPLE,
                          downsample_size=DOWNSAMPLE, num_classes=NUM_CLASSES)
    torch.save({"model": make(seed).state_dict(), "optimizer": {}, "steps": 0, "args": args}, folder / "gpt.pt")
    (folder / "gpt.json").write_text(json.dumps({"num_attention_heads": HEADS}) + "\n")
    reloaded = make(seed + 1000)
    reloaded.load_state_dict(torch.load(folder / "gpt.pt", map_location="cpu", weights_only=False)["model"],
                             strict=False)
    return reloaded


def build_c2i(checkout: Path) -> None:
    official_path(checkout)
    from autoregressive.models import generate as generate_module
    from autoregressive.models import gpt
    from tokenizer.tokenizer_image import vq_model

    folder = FIXTURES / "llamagen_c2i"
    folder.mkdir(parents=True, exist_ok=True)
    vq = build_vq(vq_model)
    torch.save({"model": vq.state_dict()}, folder / "vq.pt")  # as vq_train.py saves it (its "model" entry)

    def make(seed):
        return tiny_gpt(gpt, seed, num_classes=NUM_CLASSES, cls_token_num=1, model_type="c2i")

    seed = first_good_seed(make, lambda model: official_greedy(generate_module, model, torch.tensor(CLASSES)))
    reloaded = save_c2i_and_reload(make, seed, folder)
    codes = official_greedy(generate_module, reloaded, torch.tensor(CLASSES))
    images = official_decode(vq, codes, folder, "c2i")
    classes = ",".join(map(str, CLASSES))
    runs = [{"name": f"greedy {decoder} cfg {CFG}",
             "args": ["--classes", classes, "--cfg", CFG, "--top-k", 1, "--decoder", decoder],
             "codes": codes.tolist(), "images": images} for decoder in ("ar", "sjd")]
    write_expected(folder, {
        "repository": "FoundationVision/LlamaGen", "commit": commit_of(checkout), "packages": packages("torch"),
        "builder": "tests/conformance/build/llamagen.py c2i",
        "made_with": "autoregressive.models.gpt.Transformer(ModelArgs(dim=32, n_layer=2, n_head=2, "
                     "multiple_of=32, vocab_size=64, block_size=36, num_classes=10, model_type='c2i')) (output head, "
                     "layer Linear weights, token embeddings and RMSNorm weights re-initialised randomly; the first "
                     "weight seed whose greedy codes vary), saved as train_c2i.py saves it "
                     "({'model', 'optimizer', 'steps', 'args': Namespace}) + gpt.json with the head count; codes "
                     "from autoregressive.models.generate.generate(cfg_scale=4.0, top_k=1) on the reloaded file; "
                     "tokenizer.tokenizer_image.vq_model.VQModel (codebook 64x8, z 32, no usage buffer) with the "
                     "official Encoder/Decoder at ch=32, ch_mult (1,1), num_res_blocks=0, saved as {'model': sd}; "
                     "images from VQModel.decode_code",
    }, runs)
    print("c2i codes", codes.tolist())


# -- case 2: text-to-image ---------------------------------------------------------------------------------

T2I_CFG = 7.5  # sample_t2i.py's default
PROMPTS = ["A Red cat sits on the  green mat", "one blue dog under the sky"]
T5_WORDS = "a red cat sits on the green mat under blue sky with one two three dog".split()


def make_t5_folder(folder: Path) -> None:
    """A tiny T5 encoder folder as transformers saves one (T5EncoderModel.save_pretrained + a fast tokenizer
    that appends </s> as T5's does), laid out like a downloaded google/flan-t5-xl folder."""
    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers, processors

    vocab = {word: i for i, word in enumerate(["<pad>", "</s>", "<unk>", *T5_WORDS])}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.post_processor = processors.TemplateProcessing(single="$A </s>", special_tokens=[("</s>", 1)])
    transformers.PreTrainedTokenizerFast(tokenizer_object=tokenizer, pad_token="<pad>", eos_token="</s>",
                                         unk_token="<unk>").save_pretrained(folder)
    config = transformers.T5Config(vocab_size=len(vocab), d_model=16, d_kv=8, num_heads=2, d_ff=32, num_layers=2,
                                   feed_forward_proj="gated-gelu", pad_token_id=0, eos_token_id=1,
                                   decoder_start_token_id=0)
    torch.manual_seed(SEED)
    transformers.T5EncoderModel(config).save_pretrained(folder)


def train_t2i_args(**overrides) -> argparse.Namespace:
    """The argparse.Namespace autoregressive/train/train_t2i.py saves as checkpoint["args"]: its parser's
    defaults, with the tiny model's values where they differ."""
    args = dict(
        data_path="data", t5_feat_path="t5", short_t5_feat_path=None, cloud_save_path="ckpt", no_local_save=False,
        vq_model="VQ-16", vq_ckpt=None, codebook_size=16384, codebook_embed_dim=8, gpt_model="GPT-B",
        gpt_ckpt=None, gpt_type="t2i", vocab_size=16384, cls_token_num=120, dropout_p=0.1, token_dropout_p=0.1,
        drop_path=0.0, no_compile=False, results_dir="results", dataset="t2i", image_size=384, downsample_size=16,
        num_classes=1000, epochs=300, lr=1e-4, weight_decay=5e-2, beta1=0.9, beta2=0.95, max_grad_norm=1.0,
        global_batch_size=256, global_seed=0, num_workers=24, log_every=100, ckpt_every=5000,
        gradient_accumulation_steps=1, mixed_precision="bf16",
    )
    args.update(overrides)
    return argparse.Namespace(**args)


def official_captions(checkout: Path, t5_parent: Path, t5_name: str):
    """sample_t2i.py's caption features: the official T5Embedder (local_cache: cache_dir/dir_or_name) at fp32,
    then its left padding (inline in sample_t2i.main, restated: roll each row by its valid count, flip the mask)
    and the padding zeroed."""
    from language.t5 import T5Embedder

    embedder = T5Embedder(device="cpu", local_cache=True, cache_dir=str(t5_parent), dir_or_name=t5_name,
                          torch_dtype=torch.float32, model_max_length=120)
    caption_embs, emb_masks = embedder.get_text_embeddings(PROMPTS)
    new_emb_masks = torch.flip(emb_masks, dims=[-1])
    new_caption_embs = torch.stack([torch.cat([emb[int(mask.sum()):], emb[:int(mask.sum())]])
                                    for emb, mask in zip(caption_embs, emb_masks)])
    assert len(set(emb_masks.sum(1).tolist())) == len(PROMPTS), "prompts of one length: left padding untested"
    return new_caption_embs * new_emb_masks[:, :, None], new_emb_masks


def build_t2i(checkout: Path) -> None:
    official_path(checkout)
    from autoregressive.models import generate as generate_module
    from autoregressive.models import gpt
    from tokenizer.tokenizer_image import vq_model

    folder = FIXTURES / "llamagen_t2i"
    folder.mkdir(parents=True, exist_ok=True)
    make_t5_folder(folder / "t5")
    c_indices, c_emb_masks = official_captions(checkout, folder, "t5")
    vq = load_official_vq(vq_model)

    def make(seed):
        model = tiny_gpt(gpt, seed, caption_dim=16, cls_token_num=120, model_type="t2i")
        # caption projection and null caption at the scale of the other weights (a trained null caption is far
        # from real captions)
        for linear in (model.cls_embedding.cap_proj.fc1, model.cls_embedding.cap_proj.fc2):
            torch.nn.init.normal_(linear.weight, std=linear.in_features ** -0.5 * 2)
        torch.nn.init.normal_(model.cls_embedding.uncond_embedding, std=1.0)
        return model

    def run(model):
        with MarginRecorder(generate_module) as margins:
            codes = generate_module.generate(model, c_indices, GRID * GRID, c_emb_masks, cfg_scale=T2I_CFG,
                                             temperature=1.0, top_k=1, top_p=1.0, sample_logits=True)
        margins.check()
        check_codes(codes)
        return codes

    seed = first_good_seed(make, run, tries=60)
    model = make(seed)
    args = train_t2i_args(gpt_model="GPT-tiny", vocab_size=VOCAB, codebook_size=VOCAB, image_size=GRID * DOWNSAMPLE,
                          downsample_size=DOWNSAMPLE)
    torch.save({"model": model.state_dict(), "optimizer": {}, "steps": 0, "args": args}, folder / "gpt.pt")
    (folder / "gpt.json").write_text(json.dumps({"num_attention_heads": HEADS}) + "\n")
    reloaded = make(seed + 1000)
    reloaded.load_state_dict(torch.load(folder / "gpt.pt", map_location="cpu", weights_only=False)["model"],
                             strict=False)
    codes = run(reloaded)
    images = official_decode(vq, codes, folder, "t2i")
    prompt_args = [arg for prompt in PROMPTS for arg in ("--prompt", prompt)]
    runs = [{"name": f"greedy {decoder} cfg {T2I_CFG}",
             "args": [*prompt_args, "--cfg", T2I_CFG, "--top-k", 1, "--decoder", decoder],
             "codes": codes.tolist(), "images": images} for decoder in ("ar", "sjd")]
    write_expected(folder, {
        "repository": "FoundationVision/LlamaGen", "commit": commit_of(checkout),
        "packages": packages("torch", "transformers", "tokenizers", "accelerate", "ftfy", "beautifulsoup4"),
        "builder": "tests/conformance/build/llamagen.py t2i",
        "made_with": "t5/: transformers.T5EncoderModel(T5Config(d_model=16, 2 layers, gated-gelu)).save_pretrained "
                     "+ a word-level PreTrainedTokenizerFast appending </s>; caption features from language/t5.py "
                     "T5Embedder(local_cache=True, model_max_length=120, torch_dtype fp32, its default device_map) "
                     ".get_text_embeddings (its caption cleaning included), left-padded as sample_t2i.py does; "
                     "gpt.pt: autoregressive.models.gpt.Transformer(ModelArgs(dim=32, n_layer=2, n_head=2, "
                     "multiple_of=32, vocab_size=64, block_size=36, caption_dim=16, cls_token_num=120, "
                     "model_type='t2i')) with layer/head/embedding/cap_proj weights and uncond_embedding re-initialised "
                     "randomly (first weight seed whose greedy codes vary), saved as train_t2i.py saves it + "
                     f"gpt.json with the head count; codes from generate.generate(emb_masks, cfg_scale={T2I_CFG}, "
                     "top_k=1); images from the shared VQ's decode_code (fixtures/llamagen_c2i/vq.pt)",
    }, runs)
    print("t2i codes", codes.tolist(), "mask lengths", c_emb_masks.sum(1).tolist())


# -- case 4: LlamaGen-DD student -----------------------------------------------------------------------

DD_SPLIT = 20  # greedy codes before it, continuous outputs from it (the released B student: 80 of 256)
DD_T2 = (12, 28)  # second-step data lengths on both sides of the split
DD_TRIES = 20


def load_official_vq(vq_model):
    """The shared tiny VQ (fixtures/llamagen_c2i/vq.pt) in the official classes, loaded strictly."""
    vq = build_vq(vq_model)
    vq.load_state_dict(torch.load(FIXTURES / "llamagen_c2i" / "vq.pt", map_location="cpu")["model"], strict=True)
    return vq.eval()


def tiny_student(dd, codebook, seed):
    torch.manual_seed(seed)
    model = dd.DDTransformer(dd.ModelArgs(
        dim=DIM, n_layer=LAYERS, n_head=HEADS, multiple_of=32, vocab_size=VOCAB, block_size=GRID * GRID,
        num_classes=NUM_CLASSES, cls_token_num=1, model_type="c2i", codebook_dim=8, codebook=codebook))
    # the official init is a teacher copy plus zero/0.02 heads: random weights large enough that every input
    # (noise or data, class, position) moves the outputs
    for module in model.modules():
        if isinstance(module, torch.nn.Linear):
            torch.nn.init.normal_(module.weight, std=module.in_features ** -0.5)
            if module.bias is not None:
                torch.nn.init.normal_(module.bias, std=0.2)
        elif isinstance(module, torch.nn.Embedding):
            torch.nn.init.normal_(module.weight, std=1.0)
        elif isinstance(module, dd.RMSNorm):
            torch.nn.init.normal_(module.weight, 1.0, 0.2)
    reinit_head(model.output, std=DIM ** -0.5 * 3)
    torch.nn.init.normal_(model.final_layer_conti.scale_shift_table, std=0.3)
    return model.eval()


def official_dd(student, fewstep, codebook, labels, noise, t_list):
    """eval_fewstep.py's sampling loop (its perturb_data, the student's final_predict and get_final_x_BLC) from
    the given noise: the final sequence [B, N, C]; asserts the greedy parts rest on clear argmaxes."""
    x = noise
    for t_ar in t_list:
        t = torch.zeros([noise.shape[0]]) + t_ar
        x_t = fewstep.perturb_data(x, t, noise)
        gt_idx = (codebook[:, None, None, :] - x_t).square().sum(dim=-1).argmin(dim=0)
        _, logits = student(x_t, labels, t)
        top = logits[:, t_ar:DD_SPLIT].topk(2, dim=-1).values
        if top.numel():
            gap = (top[..., 0] - top[..., 1]).min().item()
            assert gap > 1e-3, f"near tie in the student's greedy codes (gap {gap:.1e})"
        final_predict_results = student.final_predict(x_BLC=x_t, cond_idx=labels, timestep=t, idx=gt_idx)
        x = student.get_final_x_BLC(final_predict_results, DD_SPLIT)
    return x


def build_dd(checkout: Path) -> None:
    root = checkout / "LlamaGen"
    official_path(root)
    sys.path.insert(0, str(root / "autoregressive"))
    from autoregressive.models import dd
    from tokenizer.tokenizer_image import vq_model
    import torch.nn.functional as F

    folder = FIXTURES / "llamagen_dd"
    folder.mkdir(parents=True, exist_ok=True)
    vq = load_official_vq(vq_model)
    codebook = F.normalize(vq.quantize.embedding.weight.data, p=2, dim=-1)  # as eval_fewstep.py reads it
    labels = torch.tensor(CLASSES)
    torch.manual_seed(SEED)
    noise = torch.randn([len(CLASSES), GRID * GRID, 8])

    # eval_fewstep.py stubs nn.Linear/LayerNorm.reset_parameters process-wide when imported: build first
    students = [tiny_student(dd, codebook, seed) for seed in range(DD_TRIES)]
    precision = torch.get_float32_matmul_precision()
    stub_torchvision()
    from autoregressive.sample import eval_fewstep as fewstep
    torch.set_float32_matmul_precision(precision)

    schedules = [("1 step", [0])] + [(f"2 steps t2 {t2}", [0, t2]) for t2 in DD_T2]
    for seed, student in enumerate(students):
        try:
            finals = [official_dd(student, fewstep, codebook, labels, noise, t_list) for _, t_list in schedules]
            for final in finals:  # the greedy part must vary
                codes = (codebook[:, None, None, :] - final[:, :DD_SPLIT]).square().sum(-1).argmin(0)
                check_codes(codes)
            assert all((a - b).abs().max() > 1e-3 for a, b in zip(finals, finals[1:])), "schedules agree"
            break
        except AssertionError as e:
            print(f"seed {seed}: {e}")
    else:
        raise SystemExit("no seed gave a usable student")

    torch.save({"ema": student.state_dict()}, folder / "student.pt")  # read by eval_fewstep.py --ema
    (folder / "student.json").write_text(json.dumps({"num_attention_heads": HEADS, "block_size": GRID * GRID})
                                         + "\n")
    import numpy as np
    np.save(folder / "noise.npy", noise.numpy())
    reloaded = tiny_student(dd, codebook, seed + 1000)
    missing, unexpected = reloaded.load_state_dict(
        torch.load(folder / "student.pt", map_location="cpu")["ema"], strict=False)
    assert not missing and not unexpected, (missing, unexpected)
    runs = []
    for (name, t_list), _ in zip(schedules, finals):
        final = official_dd(reloaded, fewstep, codebook, labels, noise, t_list)
        latents = final.reshape(len(CLASSES), GRID, GRID, 8).permute(0, 3, 1, 2).contiguous()
        tag = name.replace(" ", "_")
        np.save(folder / f"{tag}.npy", latents.numpy())
        images = official_decode_latents(vq, latents, folder, f"dd_{tag}")
        args = ["--classes", ",".join(map(str, CLASSES)), "--dd-steps", len(t_list), "--dd-split", DD_SPLIT]
        if len(t_list) == 2:
            args += ["--dd-t2", t_list[1]]
        runs.append({"name": name, "args": args, "latents": f"{tag}.npy", "images": images})
    write_expected(folder, {
        "repository": "microsoft/distilled_decoding", "commit": commit_of(checkout),
        "packages": packages("torch", "numpy"), "builder": "tests/conformance/build/llamagen.py dd",
        "made_with": "LlamaGen/autoregressive/models/dd.py DDTransformer(ModelArgs(dim=32, n_layer=2, n_head=2, "
                     "multiple_of=32, vocab_size=64, block_size=36, num_classes=10, codebook_dim=8, codebook=the "
                     "normalised codebook of fixtures/llamagen_c2i/vq.pt)) with every weight re-initialised "
                     "randomly (first seed whose greedy codes vary), saved as {'ema': sd} (read by "
                     "eval_fewstep.py --ema), student.json with the head count and block size; latents from "
                     "eval_fewstep.py's loop (its perturb_data, DDTransformer.final_predict, get_final_x_BLC with "
                     f"split_t {DD_SPLIT}) for t_list 0, 0,{DD_T2[0]} and 0,{DD_T2[1]} from noise.npy; images from "
                     "the official VQModel.decode of those latents (torchvision.utils.save_image stubbed for the import "
                     "where torchvision is absent)",
    }, runs)
    print("dd done, seed", seed)


def official_decode_latents(vq, latents, folder: Path, prefix: str) -> list[str]:
    with torch.no_grad():
        images = vq.decode(latents)
    names = []
    for i, image in enumerate(images):
        names.append(f"{prefix}_{i}.png")
        save_image(image.numpy(), folder / names[-1])
    return names


# -- case 3: LANTERN's LlamaGen drafter ----------------------------------------------------------------

LANTERN_GRID = 24  # cnets_llamagen.Model hard-codes the grid per input_type: c2i = 24x24 (block_size 576)
GAMMA = 4  # drafts per target forward (topK_genrate with top_k 1: depth GAMMA - 1, total_token GAMMA + 1)
DRAFTER_CONFIG = {  # data/configs/llamagen_t2i_config.json's keys, at the tiny target's sizes, for c2i
    "architectures": ["LlamaForCausalLM"], "bos_token_id": 1, "eos_token_id": 2, "hidden_act": "silu",
    "hidden_size": DIM, "initializer_range": 0.02, "intermediate_size": 96, "max_position_embeddings": 2048,
    "model_type": "llama", "num_attention_heads": HEADS, "num_hidden_layers": 1, "num_key_value_heads": HEADS,
    "pretraining_tp": 1, "rms_norm_eps": 1e-06, "rope_scaling": None, "tie_word_embeddings": False,
    "torch_dtype": "float32", "transformers_version": "4.32.0.dev0", "use_cache": True, "vocab_size": VOCAB,
    "input_type": "c2i",
}


def target_hidden(gpt, state, seed, labels, codes):
    """The official GPT's final-norm hidden states [2B, N, D] (cond rows, then null-class rows) over the
    greedy codes, teacher-forced: slot 0 the class, slot s the image token s-1 (a fresh model, no KV cache)."""
    model = tiny_gpt(gpt, seed, LANTERN_GRID, num_classes=NUM_CLASSES, cls_token_num=1, model_type="c2i")
    model.load_state_dict(state)
    seen = {}
    model.norm.register_forward_hook(lambda module, args, out: seen.update(h=out))
    both = torch.cat([labels, torch.full_like(labels, NUM_CLASSES)])
    idx = torch.cat([codes, codes])[:, :-1]
    model(idx, both, input_pos=torch.arange(idx.shape[1] + 1))
    return seen["h"], model.output


def cfg_combine(logits, cfg=CFG):
    cond, uncond = logits.chunk(2)
    return uncond + (cond - uncond) * cfg


def train_drafter(drafter, hidden, codes, head, steps=300, prefix=0, cfg=CFG):
    """Weights for the tiny drafter: regress the target's next hidden state from (hidden, token) rows, as EAGLE
    trains, so its chains get accepted and the spec test exercises drafting past the first token. ``prefix``
    rows (token 0) replay the conditioning slots before the image rows."""
    ids = torch.cat([codes, codes])[:, :-1]
    ids = torch.cat([ids.new_zeros(ids.shape[0], prefix), ids], 1)
    drafter.train()
    params = [p for p in drafter.parameters() if p.requires_grad]
    optimiser = torch.optim.Adam(params, lr=3e-3)
    with torch.enable_grad():
        for step in range(steps):
            out = drafter(hidden[:, :-1], input_ids=ids)
            loss = (out - hidden[:, 1:]).square().mean() + torch.nn.functional.cross_entropy(
                cfg_combine(head(out[:, prefix:]), cfg).flatten(0, 1), codes[:, 1:].flatten())
            optimiser.zero_grad()
            loss.backward()
            optimiser.step()
    drafter.gradient_checkpointing = False
    drafter.eval()
    print(f"drafter loss {loss.item():.3f}")


class HeadGaps:
    """The target's output head as topK_genrate calls it, recording the CFG-combined top-2 gap of each call."""

    def __init__(self, head):
        self.head, self.gaps = head, []

    def __call__(self, x):
        logits = self.head(x)
        top = cfg_combine(logits.float()).topk(2, dim=-1).values
        self.gaps.append((top[..., 0] - top[..., 1]).min().item())
        return logits


def official_spec(drafter, hidden, codes, head, batch):
    """Greedy speculative decoding with the official drafter: at n accepted codes, topK_genrate (top_k 1) drafts a
    chain of GAMMA codes from the target's hidden states of slots 0..n-1 and the codes; the target (its
    official greedy codes) accepts the leading matches plus one code. Returns fixed_at [B][N] (iteration that
    fixed each code; 0 = the prefill) and asserts no counted draft rests on a near tie."""
    N = codes.shape[1]
    fixed_at = []
    for b in range(batch):
        rows = [b, batch + b]
        at, n, iteration = [0] * N, 1, 0
        while n < N:
            iteration += 1
            drafter.reset_kv()
            ids = torch.cat([torch.zeros(1, dtype=torch.long), codes[b, :n]])[None].repeat(2, 1)
            recorder = HeadGaps(head)
            draft_tokens = drafter.topK_genrate(hidden[rows, :n], ids, recorder, None, CFG)[0]
            drafts = draft_tokens[0, 1:1 + GAMMA].tolist()
            accepted = 0
            while accepted < GAMMA and n + accepted < N and drafts[accepted] == codes[b, n + accepted].item():
                accepted += 1
            counted = min(accepted + 1, GAMMA)  # the drafts whose argmax decided the outcome
            assert min(recorder.gaps[:counted]) > 1e-3, f"near tie in a draft ({min(recorder.gaps[:counted]):.1e})"
            for position in range(n, min(n + accepted + 1, N)):
                at[position] = iteration
            n += accepted + 1
        fixed_at.append(at)
    return fixed_at


def build_lantern(checkout: Path, llamagen: Path) -> None:
    official_path(llamagen)
    from autoregressive.models import generate as generate_module
    from autoregressive.models import gpt

    folder = FIXTURES / "llamagen_lantern"
    (folder / "drafter").mkdir(parents=True, exist_ok=True)
    labels = torch.tensor(CLASSES)

    def make(seed):
        return tiny_gpt(gpt, seed, LANTERN_GRID, num_classes=NUM_CLASSES, cls_token_num=1, model_type="c2i")

    def run(model):
        return official_greedy(generate_module, model, labels, grid=LANTERN_GRID)

    seed = first_good_seed(make, run)
    model = make(seed)
    args = train_c2i_args(gpt_model="GPT-tiny", vocab_size=VOCAB, image_size=LANTERN_GRID * DOWNSAMPLE,
                          downsample_size=DOWNSAMPLE, num_classes=NUM_CLASSES)
    torch.save({"model": model.state_dict(), "optimizer": {}, "steps": 0, "args": args}, folder / "gpt.pt")
    (folder / "gpt.json").write_text(json.dumps({"num_attention_heads": HEADS}) + "\n")
    state = torch.load(folder / "gpt.pt", map_location="cpu", weights_only=False)["model"]
    reloaded = make(seed + 1000)
    reloaded.load_state_dict(state, strict=False)
    codes = run(reloaded).long()
    hidden, head = target_hidden(gpt, state, seed + 2000, labels, codes)

    # the drafter: LANTERN's classes, saved as the release is laid out (config.json + pytorch_model.bin)
    # LANTERN's models/__init__.py imports every family's EaModel (transformers 4.45 only); the drafter needs
    # none of them: register the package by path without running its __init__
    import types
    package = types.ModuleType("models")
    package.__path__ = [str(checkout / "models")]
    sys.modules["models"] = package
    from models.configs.configs import EConfig
    from models.drafters import cnets_llamagen

    torch.manual_seed(SEED)
    drafter = cnets_llamagen.Model(EConfig(**DRAFTER_CONFIG), bias=True, total_tokens=GAMMA + 1, depth=GAMMA - 1,
                                   top_k=1)
    drafter.embed_tokens.weight.data.copy_(state["tok_embeddings.weight"])  # the target's, frozen as released
    train_drafter(drafter, hidden, codes, head)
    (folder / "drafter" / "config.json").write_text(json.dumps(DRAFTER_CONFIG, indent=2) + "\n")
    torch.save(drafter.state_dict(), folder / "drafter" / "pytorch_model.bin")

    # reloaded as ea_model_llamagen.EaModel loads it: EConfig from config.json, bias from it, strict state dict
    config = json.loads((folder / "drafter" / "config.json").read_text())
    official = cnets_llamagen.Model(EConfig(**config), bias=config.get("bias", True), total_tokens=GAMMA + 1,
                                    depth=GAMMA - 1, top_k=1)
    official.load_state_dict(torch.load(folder / "drafter" / "pytorch_model.bin", map_location="cpu"), strict=True)
    official.gradient_checkpointing = False
    official.eval()
    official.init_tree()

    # teacher-forced drafter logits over the whole sequence: row p pairs hidden slot p with code p
    official.reset_kv()
    features = official(hidden[:, :-1], input_ids=torch.cat([codes, codes])[:, :-1])
    logits = cfg_combine(head(features).float())  # [B, N-1, V]: row p drafts code p+1
    top = logits.topk(2, dim=-1).values
    assert (top[..., 0] - top[..., 1]).min() > 1e-3, "near tie in the teacher-forced drafts"
    sampled_rows = list(range(0, codes.shape[1] - 1, 23))
    import numpy as np
    np.save(folder / "drafter_logits.npy", logits[:, sampled_rows].numpy())
    fixed_at = official_spec(official, hidden, codes, head, len(CLASSES))
    accepted = sum(max(row) for row in fixed_at)
    print("spec iterations per image", [max(row) for row in fixed_at], "of", codes.shape[1] - 1)
    assert accepted < len(CLASSES) * (codes.shape[1] - 1) * 0.8, "the drafter's chains are hardly accepted"

    classes = ",".join(map(str, CLASSES))
    write_expected(folder, {
        "repository": "jadohu/LANTERN", "commit": commit_of(checkout),
        "target_repository": "FoundationVision/LlamaGen", "target_commit": commit_of(llamagen),
        "packages": packages("torch", "transformers"), "builder": "tests/conformance/build/llamagen.py lantern",
        "made_with": "target: LlamaGen's gpt.Transformer as in the c2i case but block_size 576 (the 24x24 grid "
                     "cnets_llamagen hard-codes for c2i), codes from generate.generate(cfg 4, top_k 1); drafter: "
                     "models/drafters/cnets_llamagen.Model(EConfig(config.json), bias=True) with the target's token "
                     "embeddings, trained briefly (feature regression + CE on the target's greedy codes) so chains "
                     "get accepted (the LANTERN package imported without its models/__init__.py, which imports every "
                     "EaModel), saved as the release (config.json + pytorch_model.bin: its state_dict); "
                     "drafter_logits.npy: CFG-combined target-head logits of the official Model.forward "
                     f"(teacher-forced, rows {sampled_rows[0]}::{sampled_rows[1] - sampled_rows[0]}) over the target's "
                     "final-norm hidden states and the codes; fixed_at: greedy speculative decoding where each chain "
                     f"comes from Model.topK_genrate(top_k=1, depth={GAMMA - 1}, total_tokens={GAMMA + 1}, cfg 4, "
                     "logits_processor None) and the target's greedy codes accept the leading matches plus one",
    }, [{"name": f"greedy spec gamma {GAMMA} cfg {CFG}",
         "args": ["--classes", classes, "--cfg", CFG, "--top-k", 1, "--decoder", "spec", "--gamma", GAMMA],
         "codes": codes.tolist(), "fixed_at": fixed_at, "images": [],
         "drafter_logit_rows": sampled_rows, "drafts": logits.argmax(-1).tolist()}])


# -- case 3b: LANTERN's LlamaGen drafter drafting trees (static naive_extend_57, dynamic EAGLE-2) -------------------


def official_tree_spec(drafter, cnets, ea_model, kind, hidden, codes, head, batch, margins=None, gaps=None, shake=None):
    """Greedy speculative decoding with the official drafter's trees, as official_spec does with its chains: at n fixed
    codes the drafter (fresh KV) drafts a tree from the target's hidden states of slots 0..n-1 and the codes, with
    ``topK_genrate_v1`` over naive_extend_57 (static; candidates from EaModel.generate_tree_buffers and
    generate_candidates, as EaModel.generate builds them) or ``topK_genrate`` (dynamic; candidates
    ``draft_tokens[0, retrieve_indices]`` with its -1 padding); the official greedy rule (EaModel.evaluate_posterior_v1
    / evaluate_posterior, logits_processor None) picks the accepted path, the target's logits at the tree's nodes being
    its greedy codes (one-hot: the target's choice after a matching prefix; a node after a mismatch is never counted).
    Returns fixed_at [B][N] and each image's accept lengths; ``margins``/``gaps`` (trees.PathMargins/BoundaryGaps) are
    fed the recorded logits; ``shake`` = a seed: the drafter's guided logits shaken (trees.perturbed)."""
    import types
    from functools import partial

    from models.drafters import choices

    EaModel = ea_model.EaModel
    stub = types.SimpleNamespace(nearest_latents=None)
    stub.pad_path = partial(EaModel.pad_path, stub)
    buffers = EaModel.generate_tree_buffers(stub, choices.naive_extend_57, device="cpu")
    N = codes.shape[1]
    fixed_at, accepts = [], []
    recorder = trees.perturbed(cnets, drafter, shake) if shake is not None else trees.DraftLogits(cnets, drafter)
    with recorder as record:
        for b in range(batch):
            rows, n, accepted = [b, batch + b], 1, []
            while n < N:
                drafter.reset_kv()
                ids = torch.cat([torch.zeros(1, dtype=torch.long), codes[b, :n]])[None].repeat(2, 1)
                if kind == "static":
                    tree_logits = drafter.topK_genrate_v1(hidden[rows, :n], ids, head, None, CFG)
                    candidates, _, _ = EaModel.generate_candidates(stub, tree_logits, buffers["tree_indices"],
                                                                   buffers["retrieve_indices"], ids[:, -1:], None)
                else:
                    draft_tokens, retrieve, _, _ = drafter.topK_genrate(hidden[rows, :n], ids, head, None, CFG)
                    draft_tokens = torch.cat((draft_tokens, torch.full((1, 1), -1)), dim=1)
                    candidates = draft_tokens[0, retrieve]
                width = candidates.shape[1]
                ahead = codes[b, n:n + width].tolist()
                target = torch.zeros(candidates.shape[0], width, VOCAB)  # past the image's end: argmax 0, never counted
                for j, code in enumerate(ahead):
                    target[:, j, code] = 1.0
                if kind == "static":
                    _, accept, _ = EaModel.evaluate_posterior_v1(stub, target, candidates, None, None, None, None, None,
                                                                 None)
                else:
                    _, accept, _ = EaModel.evaluate_posterior(stub, target, candidates, None)
                accept = int(accept)
                if margins is not None:
                    tag = f"image {b} at {n}"
                    logits = record.rows(len(record.calls) - 1)
                    if kind == "static":
                        margins.static(logits, choices.naive_extend_57, ahead, accept, tag)
                    else:
                        margins.dynamic(logits, trees.TOP_K, trees.DEPTH, trees.TOTAL_TOKEN - 1, ahead, accept, tag,
                                        gaps)
                accepted.append(accept)
                n += accept + 1
            fixed_at.append(fixed_at_of(accepted, N))
            accepts.append(accepted)
    return fixed_at, accepts


def build_lantern_trees(checkout: Path, llamagen: Path) -> None:
    """llamagen_lantern/expected_trees.json: the committed target (gpt.pt) and drafter folder drafting LANTERN's two
    trees at its defaults, greedy."""
    official_path(llamagen)
    from autoregressive.models import generate as generate_module
    from autoregressive.models import gpt

    lantern_packages(checkout)
    from models import ea_model_llamagen
    from models.configs.configs import EConfig
    from models.drafters import choices, cnets_llamagen

    folder = FIXTURES / "llamagen_lantern"
    chain_run = json.loads((folder / "expected.json").read_text())["runs"][0]
    labels = torch.tensor(CLASSES)
    state = torch.load(folder / "gpt.pt", map_location="cpu", weights_only=False)["model"]
    reloaded = tiny_gpt(gpt, SEED, LANTERN_GRID, num_classes=NUM_CLASSES, cls_token_num=1, model_type="c2i")
    reloaded.load_state_dict(state, strict=False)
    codes = official_greedy(generate_module, reloaded, labels, grid=LANTERN_GRID).long()
    assert codes.tolist() == chain_run["codes"], "the committed codes are not the target's official greedy codes"
    hidden, head = target_hidden(gpt, state, SEED, labels, codes)

    # the drafter as EaModel loads it (EConfig from config.json, bias from it, strict state dict) at the defaults
    config = json.loads((folder / "drafter" / "config.json").read_text())
    drafter = cnets_llamagen.Model(EConfig(**config), bias=config.get("bias", True), total_tokens=trees.TOTAL_TOKEN,
                                   depth=trees.DEPTH, top_k=trees.TOP_K)
    drafter.load_state_dict(torch.load(folder / "drafter" / "pytorch_model.bin", map_location="cpu"), strict=True)
    drafter.gradient_checkpointing = False
    drafter.diff_device = False  # as EaModel sets it (one device)
    drafter.eval()
    drafter.init_tree()
    drafter.init_tree_v1(choices.naive_extend_57)

    classes = ",".join(map(str, CLASSES))
    runs = []
    for kind in ("static", "dynamic"):
        margins, gaps = trees.PathMargins(), trees.BoundaryGaps()
        fixed_at, accepts = official_tree_spec(drafter, cnets_llamagen, ea_model_llamagen, kind, hidden, codes, head,
                                               len(CLASSES), margins, gaps)
        for seed in range(trees.SHAKES):
            _, shaken = official_tree_spec(drafter, cnets_llamagen, ea_model_llamagen, kind, hidden, codes, head,
                                           len(CLASSES), shake=seed)
            assert shaken == accepts, f"{kind}: the accept lengths move when the drafter's logits are shaken"
        print(f"{kind}: target forwards per image {[max(a) for a in fixed_at]}", end="; ")
        runs.append({"name": f"greedy spec {kind} tree cfg {CFG}",
                     "args": ["--classes", classes, "--cfg", CFG, "--top-k", 1, "--decoder", "spec",
                              *trees.fastar_args(kind)],
                     "codes": codes.tolist(), "fixed_at": fixed_at, "target_forwards": [max(a) for a in fixed_at],
                     **trees.summary(margins, gaps)})
    write_expected_trees(folder, {
        "repository": "jadohu/LANTERN", "commit": commit_of(checkout),
        "target_repository": "FoundationVision/LlamaGen", "target_commit": commit_of(llamagen),
        "packages": packages("torch", "transformers"), "builder": "tests/conformance/build/llamagen.py lantern_trees",
        "made_with": "the committed gpt.pt (its codes re-made by LlamaGen's generate.generate, cfg 4, top_k 1, and "
                     "checked against expected.json) and drafter/ loaded as EaModel loads it into models/drafters/"
                     f"cnets_llamagen.Model(total_tokens={trees.TOTAL_TOKEN}, depth={trees.DEPTH}, "
                     f"top_k={trees.TOP_K}: EaModel.from_pretrained's defaults); greedy speculative decoding as the "
                     "chain case's (the drafter fresh at each iteration over the target's teacher-forced final-norm "
                     "hidden states of slots 0..n-1 and the codes): static = Model.topK_genrate_v1 over "
                     "choices.naive_extend_57 (init_tree_v1), candidates by EaModel.generate_tree_buffers + "
                     "generate_candidates, accepted by EaModel.evaluate_posterior_v1; dynamic = Model.topK_genrate, "
                     "candidates draft_tokens[0, retrieve_indices], accepted by EaModel.evaluate_posterior (both with "
                     "logits_processor None, the target's logits at the nodes one-hot at its greedy codes); fixed_at "
                     "from the accept lengths. " + trees.CHECKS,
    }, runs)


def write_expected_trees(folder: Path, source: dict, runs: list) -> None:
    (folder / "expected_trees.json").write_text(json.dumps({"source": source, "runs": runs}, indent=1,
                                                           ensure_ascii=False) + "\n")


# -- case 5: LANTERN's LlamaGen text-to-image drafter, with LANTERN's own target class and sampler -----------------

T2I_LANTERN_GRID = 16  # cnets_llamagen.Model hard-codes block_size 256 (16x16) and 119 replayed rows for t2i
T2I_CAPTION_TOKENS = 120  # ea_model_llamagen.EaModel hard-codes 120 caption slots
T2I_LANTERN_CFG = T2I_CFG
# prompts that fill the 120 caption slots (119 words + </s>): no padded caption slot. The drafter reads the target's
# hidden states of every caption slot without a mask, and LANTERN's converted class computes those of padded slots
# with its HF-style mask (a fully masked row: uniform attention over the keys at the mask's minimum, which depends on
# the dtype and on later real slots), where LlamaGen's own code and FastAR let a padded slot see itself: see the
# README's "Not covered yet"
T2I_LANTERN_PROMPTS = [" ".join(("a red cat sits on the green mat under the blue sky " * 12).split()[:119]),
                       " ".join(("one two three dog with a green cat on the red mat " * 12).split()[:119])]
T2I_TARGET_CONFIG = {  # transformers' LlamaConfig + the LlamaGen keys modeling_llamagen_kv reads (LlamaGen-T2I's)
    "vocab_size": VOCAB, "hidden_size": DIM, "intermediate_size": 96, "num_hidden_layers": LAYERS,
    "num_attention_heads": HEADS, "num_key_value_heads": HEADS, "rms_norm_eps": 1e-5, "max_position_embeddings": 512,
    "block_size": T2I_LANTERN_GRID ** 2, "cls_token_num": T2I_CAPTION_TOKENS, "caption_dim": 16, "input_type": "t2i",
    "num_classes": 1000, "class_dropout_p": 0.0, "token_dropout_p": 0.0, "resid_dropout_p": 0.0, "ffn_dropout_p": 0.0,
    "attn_dropout_p": 0.0, "rope_base": 10000, "tie_word_embeddings": False, "torch_dtype": "float16",
}
T2I_DRAFTER_CONFIG = {**DRAFTER_CONFIG, "input_type": "t2i", "caption_dim": 16, "class_dropout_p": 0.0}


def lantern_packages(checkout: Path) -> None:
    """LANTERN's models/__init__.py imports every family's EaModel (and their transformers-4.45 classes): register
    the package by path, so that only the modules a case uses are imported."""
    import types

    sys.path.insert(0, str(checkout))
    package = types.ModuleType("models")
    package.__path__ = [str(checkout / "models")]
    sys.modules["models"] = package


def left_pad(caption_embs, emb_masks):
    """sample_t2i.py's (and EaModel.generate's) left padding, restated: roll each row by its valid count, flip the
    mask, zero the padding."""
    new_emb_masks = torch.flip(emb_masks, dims=[-1])
    new_caption_embs = torch.stack([torch.cat([emb[int(mask.sum()):], emb[:int(mask.sum())]])
                                    for emb, mask in zip(caption_embs, emb_masks)])
    return new_caption_embs * new_emb_masks[:, :, None], new_emb_masks


def t2i_rows(base, prompt: str):
    """EaModel.generate's target input for one prompt: its caption features (the class's own T5Embedder), the
    null caption row, the mask of both rows (the caption mask twice)."""
    c_indices, c_emb_masks = left_pad(*base.t5_model.get_text_embeddings([prompt]))
    cond_null = torch.zeros_like(c_indices) + base.model.cls_embedding.uncond_embedding
    return torch.cat([c_indices, cond_null]), torch.cat([c_emb_masks, c_emb_masks])


def t2i_teacher_forced(base, drafter, prompt: str, codes: list[int]):
    """The target's final-norm hidden states over the caption slots and codes 0..N-2 (its forward with
    EaModel.generate's conditioning and mask, no cache) [2, 120 + N - 1, D], and the drafter over them as
    Model.topK_genrate computes its prefill rows (``Model.forward(hidden, zeros(120) + codes [:, 1:])``, default
    positions, no mask): CFG-combined logits [N - 1, V], row k drafting code k + 1."""
    from models.drafters.cnets_llamagen import cfg_logit_process

    cond_combined, mask = t2i_rows(base, prompt)
    ids = torch.tensor([codes, codes])
    full_mask = torch.cat([mask, torch.ones(2, len(codes) - 1, dtype=mask.dtype)], 1)
    hidden = base.model(input_ids=ids[:, :-1], cond_idx=cond_combined, attention_mask=full_mask,
                        use_cache=False, return_dict=True).last_hidden_state
    drafter_ids = torch.cat([torch.zeros(2, T2I_CAPTION_TOKENS, dtype=torch.long), ids], 1)[:, 1:]
    drafter.reset()
    drafter.reset_kv()
    features, _ = drafter(hidden, input_ids=drafter_ids, use_cache=True)
    logits = cfg_logit_process(base.lm_head(features), T2I_LANTERN_CFG)[0]
    return hidden, logits[T2I_CAPTION_TOKENS - 1: T2I_CAPTION_TOKENS - 1 + len(codes) - 1]



def build_lantern_t2i(checkout: Path, t5_folder: Path) -> None:
    import os
    import shutil
    import tempfile

    import numpy as np

    lantern_packages(checkout)
    from models.configs.configs import EConfig
    from models.drafters import cnets_llamagen
    from models.kv_variants import modeling_llamagen_kv
    from transformers import LlamaConfig

    official_embedder = modeling_llamagen_kv.T5Embedder

    def cpu_embedder(*args, device=None, torch_dtype=None, **kwargs):  # hard-coded 'cuda' and bf16
        return official_embedder(*args, device="cpu", torch_dtype=torch.float32, **kwargs)

    modeling_llamagen_kv.T5Embedder = cpu_embedder
    from models import ea_model_llamagen

    folder = FIXTURES / "llamagen_t2i_lantern"
    (folder / "drafter").mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp())  # the relative paths the classes open: the T5 folder, the VQ distances
    shutil.copytree(t5_folder, scratch / "ckpts/llamagen/t5/flan-t5-xl")
    (scratch / "ckpts/llamagen/vq_distances").mkdir(parents=True)
    np.save(scratch / "ckpts/llamagen/vq_distances/top_16383_indices.npy",  # only lantern=True reads it
            np.tile(np.arange(VOCAB, dtype=np.int64), (VOCAB, 1))[:, :2])
    os.chdir(scratch)

    def make(seed):
        torch.manual_seed(seed)
        model = modeling_llamagen_kv.LlamaForCausalLM(LlamaConfig(**T2I_TARGET_CONFIG)).eval()
        # the official init (std 0.02) makes greedy codes cycle: weights at unit-scale activations, norms and
        # the null caption away from their neutral init (as the t2i case)
        for name, p in model.named_parameters():
            if "norm" in name:
                torch.nn.init.normal_(p, 1.0, 0.2)
            elif name.endswith("embed_tokens.weight"):
                torch.nn.init.normal_(p, std=1.0)
            elif "cap_proj" in name:
                torch.nn.init.normal_(p, std=p.shape[-1] ** -0.5 * 2)
            elif name == "lm_head.weight":
                torch.nn.init.normal_(p, std=DIM ** -0.5 * 3)
            else:
                torch.nn.init.normal_(p, std=p.shape[-1] ** -0.5)
        torch.nn.init.normal_(model.model.cls_embedding.uncond_embedding, std=1.0)
        return model.half().float()  # the weights as stored (fp16), so the seed search sees the reloaded model

    def greedy(model):
        """The class's own generate (LANTERN's LlamaGen AR sampler), top-k 1, one prompt per call."""
        gaps = []
        original = modeling_llamagen_kv.sample

        def sample(logits, *args, **kwargs):
            top = logits[:, -1].float().topk(2, dim=-1).values
            gaps.append((top[:, 0] - top[:, 1]).min().item())
            return original(logits, *args, **kwargs)

        modeling_llamagen_kv.sample = sample
        try:
            codes = [model.generate(prompt=[p], max_length=T2I_LANTERN_GRID ** 2, temperature=1.0, top_k=1,
                                    top_p=1.0, cfg=T2I_LANTERN_CFG)[0] for p in T2I_LANTERN_PROMPTS]
        finally:
            modeling_llamagen_kv.sample = original
        codes = torch.cat(codes)
        assert min(gaps) > 1e-3, f"a greedy step has a near tie (top-2 logit gap {min(gaps):.2e})"
        check_codes(codes)
        return codes

    seed = first_good_seed(make, greedy, tries=20)
    target = make(seed)
    target.half().save_pretrained(folder / "LlamaGen-T2I", safe_serialization=True)
    base = modeling_llamagen_kv.LlamaForCausalLM.from_pretrained(folder / "LlamaGen-T2I",
                                                                 torch_dtype=torch.float32).eval()
    codes = greedy(base)

    # the drafter: LANTERN's class, the target's embeddings, trained briefly on the target's hidden states
    torch.manual_seed(SEED)
    drafter = cnets_llamagen.Model(EConfig(**T2I_DRAFTER_CONFIG), bias=True, total_tokens=GAMMA + 1,
                                   depth=GAMMA - 1, top_k=1).eval()
    drafter.embed_tokens.weight.data.copy_(base.model.embed_tokens.weight.data)
    drafter.gradient_checkpointing = False
    with torch.no_grad():
        hidden = [t2i_teacher_forced(base, drafter, prompt, codes[b].tolist())[0] for b, prompt in enumerate(T2I_LANTERN_PROMPTS)]
    hidden = torch.cat([h[:1] for h in hidden] + [h[1:] for h in hidden])  # cond rows, then uncond rows
    train_drafter(drafter, hidden, codes, base.lm_head, steps=200, prefix=T2I_CAPTION_TOKENS - 1, cfg=T2I_LANTERN_CFG)
    (folder / "drafter" / "config.json").write_text(json.dumps(T2I_DRAFTER_CONFIG, indent=2) + "\n")
    torch.save({k: v.half() for k, v in drafter.state_dict().items()}, folder / "drafter" / "pytorch_model.bin")

    # the official sampler: EaModel.from_pretrained on the two folders, greedy (temperature 0: no processor)
    model = ea_model_llamagen.EaModel.from_pretrained(
        base_model_path=str(folder / "LlamaGen-T2I"), ea_model_path=str(folder / "drafter"), total_token=GAMMA + 1,
        depth=GAMMA - 1, top_k=1, torch_dtype=torch.float32).eval()
    calls = []
    evaluate = model.evaluate_posterior
    model.evaluate_posterior = lambda *a, **k: calls.append(evaluate(*a, **k)) or calls[-1]
    run = {"codes": [], "fixed_at": [], "drafts": []}
    logits_out = []
    for b, prompt in enumerate(T2I_LANTERN_PROMPTS):
        calls.clear()
        with torch.no_grad():
            ids, mean_accept, _ = model.generate(prompt=[prompt], max_length=T2I_LANTERN_GRID ** 2, temperature=0.0,
                                                 top_k=1, top_p=1.0, cfg=T2I_LANTERN_CFG, lantern=False,
                                                 static_tree=False)
        spec_codes = ids[0].tolist()
        assert spec_codes == codes[b].tolist(), "greedy speculative decoding left the target's greedy codes"
        accepted = [int(call[1]) for call in calls]
        run["codes"].append(spec_codes)
        run["fixed_at"].append(fixed_at_of(accepted, len(spec_codes)))
        print(f"{prompt!r}: {len(accepted)} target forwards after the prefill, mean accept {mean_accept:.2f}")
        with torch.no_grad():
            _, logits = t2i_teacher_forced(model.base_model, model.ea_layer, prompt, spec_codes)
        top = logits.topk(2, dim=-1).values
        gap = (top[:, 0] - top[:, 1]).min().item()
        assert gap > 1e-3, f"near tie in the teacher-forced drafts ({gap:.1e})"
        run["drafts"].append(logits.argmax(-1).tolist())
        rows = list(range(0, logits.shape[0], 17))
        logits_out.append(logits[rows].numpy())
    assert sum(max(a) for a in run["fixed_at"]) < 0.8 * sum(len(c) - 1 for c in run["codes"]), \
        "the drafter's chains are hardly accepted"
    np.save(folder / "drafter_logits.npy", np.stack(logits_out).astype(np.float32))
    prompt_args = [arg for prompt in T2I_LANTERN_PROMPTS for arg in ("--prompt", prompt)]
    write_expected(folder, {
        "repository": "jadohu/LANTERN", "commit": commit_of(checkout),
        "packages": packages("torch", "transformers", "tokenizers", "accelerate", "ftfy", "beautifulsoup4", "numpy"),
        "builder": "tests/conformance/build/llamagen.py lantern_t2i", "t5": "fixtures/llamagen_t2i/t5",
        "made_with": "LlamaGen-T2I/: models/kv_variants/modeling_llamagen_kv.LlamaForCausalLM(LlamaConfig(hidden 32, "
                     "2 layers, 2 heads, intermediate 96, vocab 64, block_size 256, cls_token_num 120, caption_dim "
                     "16, input_type t2i)) with weights, norms and the null caption re-initialised (first seed whose "
                     "greedy codes vary), saved by its save_pretrained in fp16 (LANTERN's converted LlamaGen-T2I "
                     "layout) and reloaded by from_pretrained in fp32; its T5Embedder reads fixtures/llamagen_t2i/t5 "
                     "as ckpts/llamagen/t5/flan-t5-xl. codes: the class's own generate (top_k 1, cfg 7.5) = "
                     "models/ea_model_llamagen.py EaModel.from_pretrained(LlamaGen-T2I/, drafter/, total_token=5, "
                     "depth=3, top_k=1).generate(prompt=[p], max_length=256, temperature=0 (greedy: no logits "
                     "processor), cfg=7.5, lantern=False, static_tree=False), one prompt per call as it allows; "
                     "fixed_at from its evaluate_posterior accept lengths (iteration i fixes its accepted drafts and "
                     "the target's next code; 0 = the prefill's first code). drafter/: models/drafters/"
                     "cnets_llamagen.Model(EConfig(config.json: data/configs/llamagen_t2i_config.json's keys at the "
                     "target's sizes), bias=True) with the target's token embeddings, trained briefly (next hidden "
                     "state + CE on the greedy codes) so chains get accepted, saved as the release (config.json + "
                     "pytorch_model.bin, fp16). drafts/drafter_logits.npy: the EaModel's drafter teacher-forced over "
                     "each prompt's whole sequence as topK_genrate computes its prefill rows (target final-norm hidden "
                     "of the 120 caption slots and codes 0..N-2 from the class's forward with EaModel.generate's "
                     "caption features, null caption and mask; tokens zeros(120) + codes shifted by one; default "
                     "positions, no mask), cfg_logit_process(lm_head(.), 7.5); row k (the last caption slot + k) "
                     "drafts code k+1; rows 0::17. Prompts of 119 words (with </s>, all 120 caption slots real): the drafter "
                     "reads the target's hidden states of padded caption slots unmasked, and the class computes those "
                     "with its HF-style mask (fully masked rows), which FastAR does not reproduce (see the README). "
                     "Departures forced by the tiny CPU model: T5Embedder on 'cpu' in "
                     "fp32 (hard-coded 'cuda', bf16); ckpts/llamagen/vq_distances/top_16383_indices.npy, which "
                     "EaModel loads but only its relaxed (lantern=True) acceptance reads, is a placeholder",
    }, [{"name": f"greedy spec gamma {GAMMA} cfg {T2I_LANTERN_CFG}",
         "args": [*prompt_args, "--cfg", T2I_LANTERN_CFG, "--top-k", 1, "--decoder", "spec", "--gamma", GAMMA],
         "codes": run["codes"], "fixed_at": run["fixed_at"], "images": [], "drafts": run["drafts"],
         "drafter_logit_rows": rows}])


# -- case 5b: the same, drafting trees: LANTERN's EaModel.generate with static_tree True and False ------------------


def build_lantern_t2i_trees(checkout: Path, t5_folder: Path) -> None:
    """llamagen_t2i_lantern/expected_trees.json: the committed LlamaGen-T2I/ and drafter/ folders in LANTERN's own
    sampler at its tree defaults, greedy, one prompt per call."""
    import os
    import shutil
    import tempfile

    import numpy as np

    lantern_packages(checkout)
    from models.drafters import choices, cnets_llamagen
    from models.kv_variants import modeling_llamagen_kv

    official_embedder = modeling_llamagen_kv.T5Embedder

    def cpu_embedder(*args, device=None, torch_dtype=None, **kwargs):  # hard-coded 'cuda' and bf16
        return official_embedder(*args, device="cpu", torch_dtype=torch.float32, **kwargs)

    modeling_llamagen_kv.T5Embedder = cpu_embedder
    from models import ea_model_llamagen

    folder = (FIXTURES / "llamagen_t2i_lantern").resolve()
    chain_run = json.loads((folder / "expected.json").read_text())["runs"][0]
    scratch = Path(tempfile.mkdtemp())  # the relative paths the classes open: the T5 folder, the VQ distances
    shutil.copytree(t5_folder, scratch / "ckpts/llamagen/t5/flan-t5-xl")
    (scratch / "ckpts/llamagen/vq_distances").mkdir(parents=True)
    np.save(scratch / "ckpts/llamagen/vq_distances/top_16383_indices.npy",  # only lantern=True reads it
            np.tile(np.arange(VOCAB, dtype=np.int64), (VOCAB, 1))[:, :2])
    os.chdir(scratch)
    model = ea_model_llamagen.EaModel.from_pretrained(
        base_model_path=str(folder / "LlamaGen-T2I"), ea_model_path=str(folder / "drafter"),
        total_token=trees.TOTAL_TOKEN, depth=trees.DEPTH, top_k=trees.TOP_K, torch_dtype=torch.float32).eval()

    runs = []
    for kind in ("static", "dynamic"):
        margins, gaps = trees.PathMargins(), trees.BoundaryGaps()
        run = {"codes": [], "fixed_at": [], "target_forwards": []}
        for b, prompt in enumerate(T2I_LANTERN_PROMPTS):
            def generate(static_tree, prompt=prompt):
                return model.generate(prompt=[prompt], max_length=T2I_LANTERN_GRID ** 2, temperature=0.0, top_k=1,
                                      top_p=1.0, cfg=T2I_LANTERN_CFG, lantern=False, static_tree=static_tree)[0]

            target = chain_run["codes"][b]  # the class's own greedy codes (checked by the lantern_t2i case)
            ids, accepts = trees.ea_model_run(model, cnets_llamagen, generate, kind, target, choices.naive_extend_57,
                                              margins, gaps, tag=f"prompt {b}")
            assert ids[0].tolist() == target, f"{kind}: greedy speculative decoding left the target's greedy codes"
            for seed in range(trees.SHAKES):
                _, shaken = trees.ea_model_run(model, cnets_llamagen, generate, kind, target, choices.naive_extend_57,
                                               shake=seed)
                assert shaken == accepts, f"{kind}: the accept lengths move when the drafter's logits are shaken"
            run["codes"].append(target)
            run["fixed_at"].append(fixed_at_of(accepts, len(target)))
            run["target_forwards"].append(max(run["fixed_at"][-1]))
        print(f"{kind}: target forwards per image {run['target_forwards']}", end="; ")
        prompt_args = [arg for prompt in T2I_LANTERN_PROMPTS for arg in ("--prompt", prompt)]
        runs.append({"name": f"greedy spec {kind} tree cfg {T2I_LANTERN_CFG}",
                     "args": [*prompt_args, "--cfg", T2I_LANTERN_CFG, "--top-k", 1, "--decoder", "spec",
                              *trees.fastar_args(kind)],
                     **run, **trees.summary(margins, gaps)})
    write_expected_trees(folder, {
        "repository": "jadohu/LANTERN", "commit": commit_of(checkout),
        "packages": packages("torch", "transformers", "tokenizers", "accelerate", "ftfy", "beautifulsoup4", "numpy"),
        "builder": "tests/conformance/build/llamagen.py lantern_t2i_trees", "t5": "fixtures/llamagen_t2i/t5",
        "made_with": "models/ea_model_llamagen.py EaModel.from_pretrained(LlamaGen-T2I/, drafter/, "
                     f"total_token={trees.TOTAL_TOKEN}, depth={trees.DEPTH}, top_k={trees.TOP_K}: its defaults, "
                     "torch_dtype fp32).generate(prompt=[p], max_length=256, temperature=0 (greedy: no logits "
                     "processor), cfg=7.5, lantern=False, static_tree=True (tree_choices naive_extend_57: "
                     "topK_genrate_v1, evaluate_posterior_v1) or False (topK_genrate, evaluate_posterior)), one "
                     "prompt per call as it allows, the lantern_t2i case's prompts (all 120 caption slots real: no "
                     "padded-caption artefact) and set-up (T5Embedder on 'cpu' in fp32, the vq_distances placeholder); "
                     "codes asserted equal to expected.json's (the target class's greedy codes); fixed_at from the "
                     "evaluate_posterior(_v1) accept lengths; target_forwards: the iterations that fixed the 256 "
                     "codes (its loop runs on until new_token > max_length). " + trees.CHECKS,
    }, runs)


# -- case 6: ZipAR's parallel rows -----------------------------------------------------------------------

ZIPAR_WINDOWS = (2, 4)  # the reference's zipar_window_size (FastAR's --zipar-lead) on a 6-wide grid


class ForwardRecorder:
    """Counts the model forwards after the prefill and records the positions each one feeds."""

    def __init__(self, model):
        self.model, self.original, self.positions = model, model.forward, []

    def __enter__(self):
        def forward(idx, cond_idx, input_pos=None, *args, **kwargs):
            if idx is not None:  # the prefill feeds the class alone (idx None)
                self.positions.append([int(p) for p in input_pos])
            return self.original(idx, cond_idx, input_pos, *args, **kwargs)
        self.model.forward = forward
        return self

    def __exit__(self, *exc):
        del self.model.forward


def build_zipar(checkout: Path) -> None:
    """ZipAR's own LlamaGen (LlamaGen-ZipAR/autoregressive/models/gpt.py, LlamaGen's Transformer with ZipAR's row
    bookkeeping) and its sampler (generate_zipar.generate) at two windows, greedy."""
    official_path(checkout / "LlamaGen-ZipAR")
    from autoregressive.models import generate_zipar as generate_module
    from autoregressive.models import gpt

    folder = FIXTURES / "llamagen_zipar"
    folder.mkdir(parents=True, exist_ok=True)

    def make(seed):
        return tiny_gpt(gpt, seed, num_classes=NUM_CLASSES, cls_token_num=1, model_type="c2i")

    def run(model, window):
        model.reset_zipar()
        model.zipar_window_size = window
        with ForwardRecorder(model) as forwards:
            codes = official_greedy(generate_module, model, torch.tensor(CLASSES))
        return codes, forwards.positions

    seed = first_good_seed(make, lambda model: [run(model, w) for w in ZIPAR_WINDOWS])
    reloaded = save_c2i_and_reload(make, seed, folder)
    classes = ",".join(map(str, CLASSES))
    runs = []
    for window in ZIPAR_WINDOWS:
        codes, positions = run(reloaded, window)
        runs.append({"name": f"greedy zipar window {window} cfg {CFG}",
                     "args": ["--classes", classes, "--cfg", CFG, "--top-k", 1, "--decoder", "zipar",
                              "--zipar-lead", window, "--zipar-attention", "reference"],
                     "codes": codes.tolist(), "images": [], "forwards": len(positions),
                     "fed_positions": positions})
        print(f"zipar window {window}: {len(positions)} forwards, codes {codes.tolist()}")
    write_expected(folder, {
        "repository": "ThisisBillhe/ZipAR", "commit": commit_of(checkout), "packages": packages("torch"),
        "builder": "tests/conformance/build/llamagen.py zipar",
        "made_with": "LlamaGen-ZipAR/autoregressive/models/gpt.Transformer with the c2i case's tiny ModelArgs and "
                     "re-initialisation (the first weight seed whose greedy codes vary at both windows), saved as "
                     "train_c2i.py saves it + gpt.json; codes from LlamaGen-ZipAR/autoregressive/models/"
                     "generate_zipar.generate(cfg_scale=4.0, top_k=1) on the reloaded file with zipar_window_size "
                     f"{' and '.join(map(str, ZIPAR_WINDOWS))} (reset_zipar() between runs); fed_positions: the "
                     "input_pos of every model forward after the prefill (the class token is slot 0, image token p "
                     "slot p + 1)",
    }, runs)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("case", choices=["c2i", "t2i", "dd", "lantern", "lantern_t2i", "zipar", "lantern_trees",
                                         "lantern_t2i_trees"])
    parser.add_argument("--official", required=True, type=Path, help="checkout of the case's official repository")
    parser.add_argument("--llamagen", type=Path, help="lantern: checkout of FoundationVision/LlamaGen")
    parser.add_argument("--commit", help="the --official checkout's commit, where it is no git work tree")
    parser.add_argument("--llamagen-commit", help="the --llamagen checkout's commit, where it is no git work tree")
    args = parser.parse_args()
    if args.commit:
        COMMITS[args.official.resolve()] = args.commit
    if args.llamagen_commit:
        COMMITS[args.llamagen.resolve()] = args.llamagen_commit
    torch.set_grad_enabled(False)
    if args.case in ("lantern", "lantern_trees"):
        if args.llamagen is None:
            parser.error(f"{args.case} needs --llamagen (the target's official code)")
        build = build_lantern if args.case == "lantern" else build_lantern_trees
        build(args.official.resolve(), args.llamagen.resolve())
    elif args.case in ("lantern_t2i", "lantern_t2i_trees"):
        build = build_lantern_t2i if args.case == "lantern_t2i" else build_lantern_t2i_trees
        build(args.official.resolve(), (FIXTURES / "llamagen_t2i" / "t5").resolve())
    else:
        {"c2i": build_c2i, "t2i": build_t2i, "dd": build_dd, "zipar": build_zipar}[args.case](args.official.resolve())


if __name__ == "__main__":
    main()
