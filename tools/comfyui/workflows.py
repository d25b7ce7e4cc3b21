"""Writes the example workflows in workflows/ (UI format, as the web UI saves them) from a running
ComfyUI's /object_info, so sockets and widget order always match the nodes. Thumbnails (.jpg) are made
by tools/comfyui/browser.py from the canvas.

    .comfyui/venv/bin/python tools/comfyui/workflows.py [--thumbnails]
starts its own ComfyUI, writes workflows/*.json and, with --thumbnails, their .jpg from headless Chromium.
"""
from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

import harness

OUT = harness.ROOT / "workflows"
# LiteGraph's NODE_TITLE_HEIGHT, NODE_SLOT_HEIGHT and NODE_WIDGET_HEIGHT (frontend 1.32 to 1.58 at least)
TITLE_HEIGHT, SLOT_HEIGHT, WIDGET_HEIGHT = 30, 20, 20
TEXT_BOX_HEIGHT = 50  # a multiline STRING widget: the frontend's text box at its minimum height
GAP = 30  # between stacked nodes: newer frontends draw the pack's badge above a node's title bar
# nodes saved taller than the frontend makes them: web/js/fastar_stats.js grows a Stats node to show the stats
MIN_HEIGHTS = {"FastARStats": 230}

# Files the real-checkpoint workflows name: the LlamaGen release's own file names.
LLAMAGEN_C2I = "c2i_L_256.pt"
LLAMAGEN_VQ_C2I = "vq_ds16_c2i.pt"
LLAMAGEN_T2I = "t2i_XL_stage1_256.pt"
LLAMAGEN_VQ_T2I = "vq_ds16_t2i.pt"
FLAN_T5 = "flan-t5-xl/"
LANTERN_DRAFTER_T2I = "llamagen_drafter/"  # LANTERN's released drafter for LlamaGen T2I stage I (jadohu/llamagen_drafter)
DEMO_DRAFTER = "demo_drafter/"
# The MAR release's files (LTH14/mar: pretrained_models/mar/mar_*/checkpoint-last.pth, pretrained_models/vae/kl16.ckpt)
MAR_HUGE = "mar_huge.pth"
MAR_BASE = "mar_base.pth"
MAR_KL16 = "kl16.ckpt"
DEMO_MAR, DEMO_MAR_DRAFT, DEMO_KL = "demo_mar.safetensors", "demo_mar_draft.safetensors", "demo_kl_vae.safetensors"
# The VAR release (FoundationVision/var on Hugging Face) and the DD release's VAR-DD students
VAR_D30, VAR_VQVAE, VAR_DD_D24 = "var_d30.pth", "vae_ch160v4096z32.pth", "var-d24.pth"
DEMO_DD = "demo_dd.safetensors"
DEMO_VAR, DEMO_VAR_VQVAE, DEMO_VAR_DD = "demo_var.safetensors", "demo_var_vqvae.safetensors", "demo_var_dd.safetensors"
DEMO_VAR_TOP_P = 0.7  # the demo VAR's setting (demo_recipes/train_var.py JUDGED: the release's cfg 1.5 with top-p 0.7)
DEMO_DD_TOP_K = 8  # the demo student's teacher settings (its pairs): cfg 2.0, top-k 8
# The Distilled Decoding release (microsoft/distilled_decoding on Hugging Face: LlamaGen-DD/llamagen-B.pt, -L.pt)
LLAMAGEN_DD_B = "llamagen-B.pt"
# Text-to-image releases, as folders: Alpha-VLLM/Lumina-mGPT-7B-768, deepseek-ai/Janus-Pro-7B; Meta's Chameleon VQGAN
LUMINA_768 = "Lumina-mGPT-7B-768/"
ANOLE_7B = "Anole-7b-v0.1-hf/"  # leloy/Anole-7b-v0.1-hf: GAIR's Anole converted to transformers' layout
LANTERN_DRAFTER_ANOLE = "anole_drafter/"  # LANTERN's released drafter for Anole (jadohu/anole_drafter)
JANUS_PRO_7B = "Janus-Pro-7B/"
CHAMELEON_VQGAN = "vqgan.ckpt"
# Emu3 in transformers' layout (BAAI/Emu3-Gen-hf: one folder, its VQ model inside) and in BAAI's (BAAI/Emu3-Gen with
# the separate BAAI/Emu3-VisionTokenizer folder)
EMU3_GEN_HF, EMU3_GEN, EMU3_VISION_TOKENIZER = "Emu3-Gen-hf/", "Emu3-Gen/", "Emu3-VisionTokenizer/"
DEMO_TEXT, DEMO_VQGAN = "demo_text/", "demo_vqgan.safetensors"
# Infinity (FoundationVision/Infinity on Hugging Face): the 2B's raw state dict and its d32 BSQ VAE; the 8B's folder
# of safetensors shards and its d56 patchify VAE (14 bits per 8 px cell, folded 2 x 2 into a token's 56)
INFINITY_2B, INFINITY_VAE_2B = "infinity_2b_reg.pth", "infinity_vae_d32reg.pth"
INFINITY_8B, INFINITY_VAE_8B = "infinity_8b_weights/", "infinity_vae_d56_f8_14_patchify.pth"
NO_T5 = "(none: the model reads the prompt itself)"


def widget_slots(info: dict) -> list[tuple[object, int]]:
    """The widgets the frontend gives a node of this /object_info entry, in order, as ``(default value, height)``:
    one per widget input and, after a seed with control_after_generate, the frontend's own combo for it."""
    slots = []
    for _, kind, options, is_widget in harness.node_inputs(info):
        if is_widget:
            choices = (kind if isinstance(kind, list) else options.get("options")) or [None]
            height = TEXT_BOX_HEIGHT if options.get("multiline") else WIDGET_HEIGHT
            slots.append((options.get("default", choices[0]), height))
            if options.get("control_after_generate"):
                slots.append(("fixed", WIDGET_HEIGHT))  # an example keeps its seed
    return slots


def node_height(info: dict) -> int:
    """The height below the title bar that LiteGraph's ``LGraphNode.computeSize()`` gives a node of this
    /object_info entry: a row per socket (inputs or outputs, whichever are more), each widget plus 4, margins."""
    sockets = sum(not is_widget for *_, is_widget in harness.node_inputs(info))
    slots = widget_slots(info)
    widgets = sum(height + 4 for _, height in slots) + 8 if slots else 0
    return max(sockets, len(info["output"]), 1) * SLOT_HEIGHT + widgets + 6


def below(node: dict) -> tuple[int, int]:
    """Where the next node of a column goes: under ``node``, with the new node's title bar clear of it."""
    return node["pos"][0], node["pos"][1] + node["size"][1] + GAP + TITLE_HEIGHT


class Graph:
    def __init__(self, info: dict):
        self.info, self.nodes, self.links, self.groups = info, [], [], []

    def node(self, kind: str, pos, widgets=(), title=None, width=320, height=0, color=None):
        """A node of ``kind`` with every widget's value (``widgets``, then the defaults of the widgets after
        them), at least ``height`` tall and never smaller than the frontend would make it."""
        info = self.info.get(kind)
        inputs, outputs, values = [], [], list(widgets)
        if info is not None:
            slots = widget_slots(info)
            assert len(values) <= len(slots), f"{kind} has {len(slots)} widgets, given {len(values)} values"
            values += [default for default, _ in slots[len(values):]]
            inputs = [{"name": name, "type": kind_in, "link": None}
                      for name, kind_in, _, is_widget in harness.node_inputs(info) if not is_widget]
            for i, (name, kind_out) in enumerate(zip(info["output_name"], info["output"])):
                outputs.append({"name": name, "type": kind_out, "links": [], "slot_index": i})
            height = max(height, node_height(info), MIN_HEIGHTS.get(kind, 0))
        node = {"id": len(self.nodes) + 1, "type": kind, "pos": list(pos), "size": [width, height], "flags": {},
                "order": len(self.nodes), "mode": 0, "inputs": inputs, "outputs": outputs,
                "properties": {"Node name for S&R": kind}, "widgets_values": values}
        if title:
            node["title"] = title
        if color:
            node["color"], node["bgcolor"] = color
        self.nodes.append(node)
        return node

    def note(self, pos, text: str, width=420, height=180, title="Note"):
        return self.node("Note", pos, [text], title=title, width=width, height=height)

    def connect(self, src: dict, output: str, dst: dict, input_name: str):
        slot = next(o for o in src["outputs"] if o["name"] == output)
        target = next(i for i in dst["inputs"] if i["name"] == input_name)
        link_id = len(self.links) + 1
        self.links.append([link_id, src["id"], slot["slot_index"], dst["id"], dst["inputs"].index(target),
                           slot["type"]])
        slot["links"].append(link_id)
        target["link"] = link_id

    def group(self, title, bounding, color="#3f789e"):
        self.groups.append({"title": title, "bounding": list(bounding), "color": color, "font_size": 24, "flags": {}})

    def fitted_view(self, canvas=(1440, 780), clear=(80, 110, 40, 40)) -> dict:
        """The saved view (ComfyUI opens a workflow at its ``ds``): the whole graph fits a laptop's browser,
        clear of the side bar and the menu and tab bars that lie over the canvas (left, top, right, bottom)."""
        boxes = [(n["pos"][0], n["pos"][1] - TITLE_HEIGHT, n["pos"][0] + n["size"][0], n["pos"][1] + n["size"][1])
                 for n in self.nodes] + [(x, y, x + w, y + h) for x, y, w, h in (g["bounding"] for g in self.groups)]
        x0, y0 = min(b[0] for b in boxes), min(b[1] for b in boxes)
        x1, y1 = max(b[2] for b in boxes), max(b[3] for b in boxes)
        left, top, right, bottom = clear
        scale = min(1.0, (canvas[0] - left - right) / (x1 - x0), (canvas[1] - top - bottom) / (y1 - y0))
        return {"scale": round(scale, 4), "offset": [round(left / scale - x0, 1), round(top / scale - y0, 1)]}

    def to_json(self) -> dict:
        return {"last_node_id": len(self.nodes), "last_link_id": len(self.links), "nodes": self.nodes,
                "links": self.links, "groups": self.groups, "config": {}, "extra": {"ds": self.fitted_view()},
                "version": 0.4}


def sampler_widgets(seed=7, cfg=2.0, temperature=1.0, top_k=0, top_p=1.0, batch=1):
    return [seed, "fixed", cfg, temperature, top_k, top_p, batch]


SJD = dict(window=16, init="random", coupling="independent")


def loaders(g: Graph, model: str, vq: str):
    ar = g.node("FastARLoadModel", (0, 0), [model, "auto"])
    vq_node = g.node("FastARLoadVQ", below(ar), [vq, "auto"])
    return ar, vq_node


def has_input(node: dict, name: str) -> bool:
    return any(socket["name"] == name for socket in node["inputs"])


def wire_sampler(g: Graph, ar, vq, conditioner, sampler, decode, stats) -> None:
    """The links every FastAR graph has: model and conditioning into the sampler, the VQ into its live
    preview (LANTERN's codebook input) and the decoder, tokens into the decoder, the decode statistics
    into the stats node."""
    g.connect(ar, "model", sampler, "model")
    g.connect(conditioner, "conditioning", sampler, "conditioning")
    g.connect(vq, "vq", sampler, "vq" if has_input(sampler, "vq") else "preview_vq")
    g.connect(vq, "vq", decode, "vq")
    g.connect(sampler, "tokens", decode, "tokens")
    g.connect(sampler, "stats", stats, "stats")


def fed_by_model(g: Graph, ar, kind: str, pos, widgets, **style):
    """A node whose ``model`` input is the AR model (Class Label, Text Conditioning, Load Drafter)."""
    node = g.node(kind, pos, widgets, **style)
    g.connect(ar, "model", node, "model")
    return node


def single_sampler(g: Graph, ar, vq, conditioner, kind: str, widgets, prefix: str):
    """One sampler with its VQ Decode, Save Image and Stats: the layout of the one-sampler workflows. The sampler
    and the Stats node."""
    sampler = g.node(kind, (360, 0), widgets)
    decode = g.node("FastARVQDecode", (720, 0), [])
    save = g.node("SaveImage", (1060, 0), [prefix], width=360)
    stats = g.node("FastARStats", below(decode), [])
    wire_sampler(g, ar, vq, conditioner, sampler, decode, stats)
    g.connect(decode, "image", save, "images")
    return sampler, stats


def demo_sjd(info) -> dict:
    g = Graph(info)
    ar, vq = loaders(g, "demo_c2i.safetensors", "demo_vq.safetensors")
    label = fed_by_model(g, ar, "FastARClassLabel", below(vq), ["circle (demo 0)", -1])
    sampler, stats = single_sampler(g, ar, vq, label, "FastARSamplerSJD",
                                    sampler_widgets(batch=4) + [32, "random", "independent"], "FastAR_demo")
    amap = g.node("FastARAcceptanceMap", below(stats), [16])
    preview = g.node("PreviewImage", (1060, amap["pos"][1]), [], width=360)
    g.connect(sampler, "stats", amap, "stats")
    g.connect(amap, "image", preview, "images")
    g.note(below(label),
           "FastAR demo: Speculative Jacobi Decoding (SJD) on the bundled demo model, no download.\n\n"
           "Press Run. The sampler shows a live preview (start ComfyUI with --preview-method auto), "
           "FastAR Stats shows how many tokens each model forward fixed, and the acceptance map shows "
           "when each token was fixed.\n\nSJD is lossless: same distribution as plain AR sampling.",
           width=320, height=260)
    return g.to_json()


def compare(info) -> dict:
    return comparison(
        info, "ring (demo 5)",
        "AR vs SJD vs GSD on the same class and seed.\n\nAR is the exact baseline (one forward per "
        "token). SJD is lossless (same distribution as AR, but a given seed gives a different image). "
        "GSD is relaxed: it trades fidelity for speed; group 1 is exactly SJD.\n\nThe SJD and GSD "
        "stats take the AR stats as baseline and show the measured speed-up.",
        [("FastARSamplerSJD", "SJD (lossless)", sampler_widgets(seed=3) + [16, "random", "independent"]),
         ("FastARSamplerGSD", "GSD (relaxed)", sampler_widgets(seed=3) + [16, "random", "independent", 10, 0.15, 0.5])])


def demo_zipar_compare(info) -> dict:
    return comparison(
        info, "circle (demo 0)",
        "AR vs ZipAR on the same class and seed.\n\nAfter the first two rows, ZipAR starts each row once the row "
        "above has `lead` tokens, so every forward extends several rows: the acceptance maps show the rows running "
        "side by side. It is relaxed: a token sees the rows above only `lead` columns ahead of it (lead = the image's width in "
        "tokens is plain AR). row_window 2 or more adds Jacobi drafts inside each row, verified exactly within "
        "what ZipAR shows each token.\n\nThe stats take the AR stats as baseline and show the measured speed-up.",
        [("FastARSamplerZipAR", "ZipAR, lead 4", sampler_widgets(seed=3) + [4, 1]),
         ("FastARSamplerZipAR", "ZipAR + drafts, lead 4", sampler_widgets(seed=3) + [4, 4])])


def demo_speed_dial(info) -> dict:
    return comparison(
        info, "ring (demo 5)",
        "FastAR Sampler: one node, one choice, how fast. It picks the decoder and its settings that measured best "
        "for the model, its drafter (the demo's own) and this device, and its Stats say what it picked and why.\n\n"
        "lossless samples exactly the model's distribution (on a CPU that is plain sampling: a window of tokens "
        "costs more there than it saves); balanced is the fastest within 5 points of plain sampling's class "
        "accuracy; fast within 10.\n\nEach Stats node takes the AR stats as baseline and shows the measured "
        "speed-up.",
        [("FastARSampler", f"FastAR Sampler, {speed}", [3, "fixed", speed, 1]) for speed in ("lossless", "balanced",
                                                                                           "fast")])


def comparison(info, label_name: str, note: str, rows: list) -> dict:
    """Plain AR and each of ``rows`` (node kind, title, widgets) on the demo model, same class and seed: the image, the
    stats against AR's, the acceptance map."""
    g = Graph(info)
    ar, vq = loaders(g, "demo_c2i.safetensors", "demo_vq.safetensors")
    label = fed_by_model(g, ar, "FastARClassLabel", below(vq), [label_name, -1])
    g.note(below(label), note, width=320, height=280)
    ar_stats = None
    for i, (kind, title, widgets) in enumerate([("FastARSamplerAR", "AR (baseline)", sampler_widgets(seed=3))] + rows):
        y = i * 720  # room for the sampler's live preview
        sampler = g.node(kind, (360, y), widgets, title=f"Sampler: {title}")
        decode = g.node("FastARVQDecode", (720, y), [])
        image = g.node("PreviewImage", (1060, y), [], title=f"Image: {title}", width=300)
        stats = g.node("FastARStats", below(decode), [], title=f"Stats: {title}")
        amap = g.node("FastARAcceptanceMap", (1380, y), [16], width=360)  # its view's title in DejaVu Sans too
        amap_view = g.node("PreviewImage", below(amap), [], title=f"Acceptance map: {title}", width=360)
        wire_sampler(g, ar, vq, label, sampler, decode, stats)
        g.connect(decode, "image", image, "images")
        g.connect(sampler, "stats", amap, "stats")
        g.connect(amap, "image", amap_view, "images")
        if ar_stats is None:
            ar_stats = sampler
        else:
            g.connect(ar_stats, "stats", stats, "ar_baseline")
        g.group(title, (340, y - 40, 1400, 700))
    return g.to_json()


def llamagen_c2i(info) -> dict:
    g = Graph(info)
    ar, vq = loaders(g, LLAMAGEN_C2I, LLAMAGEN_VQ_C2I)
    label = fed_by_model(g, ar, "FastARClassLabel", below(vq), ["golden retriever (207)", -1])
    single_sampler(g, ar, vq, label, "FastARSamplerSJD",
                   sampler_widgets(seed=42, cfg=4.0, top_k=2000) + [32, "random", "gumbel"], "FastAR_llamagen_c2i")
    g.note(below(label),
           f"LlamaGen class-to-image (ImageNet) with SJD.\n\nDownload from the LlamaGen release "
           f"(FoundationVision/LlamaGen on Hugging Face) into ComfyUI/models/fastar/:\n- {LLAMAGEN_C2I} "
           f"(or any c2i_*.pt: B, L, XL, XXL, 3B; a _384 file runs at 384 px by its name: set image_size on the "
           f"loader if you renamed it)\n- {LLAMAGEN_VQ_C2I}\nthen press R and "
           "pick them in the loaders. Official settings: cfg 4.0, top-k 2000.", width=320, height=260)
    return g.to_json()


def dd_widgets(seed=7, batch=1, steps=2, t2=0, split=-1, regenerate=-1, teacher_cfg=2.0, teacher_top_k=0):
    return [seed, "fixed", batch, steps, t2, split, regenerate, teacher_cfg, teacher_top_k]


def llamagen_dd(info) -> dict:
    g = Graph(info)
    ar, vq = loaders(g, LLAMAGEN_DD_B, LLAMAGEN_VQ_C2I)
    label = fed_by_model(g, ar, "FastARClassLabel", below(vq), ["golden retriever (207)", -1])
    single_sampler(g, ar, vq, label, "FastARSamplerDD", dd_widgets(seed=42), "FastAR_llamagen_dd")
    g.note(below(label),
           f"Distilled Decoding: a LlamaGen-L-sized image in 2 model forwards instead of 256.\n\nDownload "
           f"into ComfyUI/models/fastar/:\n- {LLAMAGEN_DD_B} (or llamagen-L.pt) from the Distilled Decoding "
           f"release (microsoft/distilled_decoding on Hugging Face, folder LlamaGen-DD)\n- {LLAMAGEN_VQ_C2I} "
           "from the LlamaGen release (FoundationVision/LlamaGen)\nthen press R and pick them in the "
           "loaders. steps 1 is faster, 2 is better; the same seed gives the same image.",
           width=320, height=260)
    return g.to_json()


def teacher_and_student(g: Graph, teacher_file: str, decoder_file: str, student_file: str, title: str):
    """The loaders of a demo teacher, its image decoder and its student, and a Class Label (ring) for each model."""
    teacher, decoder = loaders(g, teacher_file, decoder_file)
    student = g.node("FastARLoadModel", below(decoder), [student_file, "auto"], title=title)
    teacher_label = fed_by_model(g, teacher, "FastARClassLabel", below(student), ["ring (demo 5)", -1])
    student_label = fed_by_model(g, student, "FastARClassLabel", below(teacher_label), ["ring (demo 5)", -1])
    return teacher, decoder, student, [teacher_label, student_label]


def demo_dd_compare(info) -> dict:
    g = Graph(info)
    teacher, vq, student, labels = teacher_and_student(g, "demo_c2i.safetensors", "demo_vq.safetensors", DEMO_DD,
                                                       "Load DD student")
    g.note(below(labels[1]),
           "Distilled Decoding (DD) on the bundled demo model and its bundled DD student, same class "
           "in every column.\n\nAR samples one token per forward (256 forwards). The student maps "
           "one seeded noise image to all tokens in 1 forward, or 2 (better); the same seed gives "
           "the same image. The hybrid lets the teacher resample tokens regenerate..t2-1 between the "
           "two steps (more forwards, closer to the teacher).\n\nDD is relaxed: a fast "
           "approximation of the teacher's samples. Each Stats node takes the AR stats as baseline "
           "and shows the measured speed-up. The teacher samples at cfg 2.0 and top-k 8, the settings the "
           "student was distilled at.", width=320, height=350)
    teacher_widgets = sampler_widgets(seed=3, top_k=DEMO_DD_TOP_K)
    ar = drafter_columns(g, teacher, vq, labels[0], None, [("FastARSamplerAR", "AR (teacher)", teacher_widgets)],
                         decode_y=760)[0]
    dd = [("FastARSamplerDD", title, dd_widgets(seed=3, steps=steps, regenerate=regenerate, teacher_top_k=DEMO_DD_TOP_K))
          for title, steps, regenerate in (("DD, 1 step", 1, -1), ("DD, 2 steps", 2, -1),
                                           ("DD hybrid (teacher 40..79)", 2, 40))]
    hybrid = drafter_columns(g, student, vq, labels[1], None, dd, decode_y=760, baseline=ar,
                             first_column=1)[-1]
    g.connect(teacher, "model", hybrid, "teacher")
    return g.to_json()


def demo_var_compare(info) -> dict:
    g = Graph(info)
    teacher, vqvae, student, labels = teacher_and_student(g, DEMO_VAR, DEMO_VAR_VQVAE, DEMO_VAR_DD,
                                                          "Load VAR-DD student")
    g.note(below(labels[1]),
           "VAR (next-scale prediction) on the bundled demo VAR and its bundled VAR-DD student, same class "
           "in every column.\n\nVAR draws a whole scale per forward: 6 forwards for the demo's 1, 2, 3, 4, "
           "6, 8 token maps (the real VAR: 10). The VAR-DD student maps one seeded noise image to every "
           "scale in 1 forward, or 2 (better); the same seed gives the same image.\n\nThe VQVAE goes into "
           "the VAR sampler too: VAR samples through it. The demo's settings: cfg 1.5 (ramped over the scales) "
           "and top-p 0.7, what the student learnt from. Each Stats node takes VAR's stats as baseline and "
           "shows the measured speed-up.", width=320, height=360)
    var = drafter_columns(g, teacher, vqvae, labels[0], None,
                          [("FastARSamplerAR", "VAR, one forward per scale",
                            sampler_widgets(seed=3, cfg=1.5, top_p=DEMO_VAR_TOP_P))],
                          decode_y=760)[0]
    drafter_columns(g, student, vqvae, labels[1], None,
                    [("FastARSamplerDD", title, dd_widgets(seed=3, steps=steps)) for title, steps in
                     (("VAR-DD, 1 step", 1), ("VAR-DD, 2 steps", 2))],
                    decode_y=760, baseline=var, first_column=1)
    return g.to_json()


def var_official(info) -> dict:
    g = Graph(info)
    ar, vqvae = loaders(g, VAR_D30, VAR_VQVAE)
    label = fed_by_model(g, ar, "FastARClassLabel", below(vqvae), ["golden retriever (207)", -1])
    single_sampler(g, ar, vqvae, label, "FastARSamplerAR", sampler_widgets(seed=42, cfg=1.5, top_k=900, top_p=0.96),
                   "FastAR_var_d30")
    g.note(below(label),
           f"VAR (next-scale prediction): VAR-d30 makes a 256 px image in 10 forwards, one per scale.\n\n"
           f"Download from the VAR release (FoundationVision/var on Hugging Face) into "
           f"ComfyUI/models/fastar/:\n- {VAR_D30} (or var_d16/d20/d24.pth)\n- {VAR_VQVAE}\nthen press R and "
           "pick them in the loaders. The VQVAE goes into the sampler too: VAR samples through it. Official "
           "settings: cfg 1.5 (ramped over the scales), top-k 900, top-p 0.96.", width=320, height=300)
    return g.to_json()


def var_dd_official(info) -> dict:
    g = Graph(info)
    ar, vqvae = loaders(g, VAR_DD_D24, VAR_VQVAE)
    label = fed_by_model(g, ar, "FastARClassLabel", below(vqvae), ["golden retriever (207)", -1])
    single_sampler(g, ar, vqvae, label, "FastARSamplerDD", dd_widgets(seed=42, steps=1), "FastAR_var_dd_d24")
    g.note(below(label),
           f"VAR-DD: a VAR-d24-sized image in one forward instead of ten.\n\nDownload into "
           f"ComfyUI/models/fastar/:\n- {VAR_DD_D24} from the Distilled Decoding release "
           f"(microsoft/distilled_decoding on Hugging Face, folder VAR-DD; or var-d16/d20.pth)\n- {VAR_VQVAE} "
           "from the VAR release (FoundationVision/var)\nthen press R and pick them in the loaders. steps 1 "
           "is fastest, 2 is better; the same seed gives the same image.", width=320, height=300)
    return g.to_json()


def t2i_inputs(g: Graph):
    """The LlamaGen t2i loaders and the prompt."""
    ar, vq = loaders(g, LLAMAGEN_T2I, LLAMAGEN_VQ_T2I)
    text = fed_by_model(g, ar, "FastARTextConditioning", below(vq),
                        ["a photo of a red apple on a wooden table", FLAN_T5], width=320)
    return ar, vq, text


def llamagen_t2i(info) -> dict:
    g = Graph(info)
    ar, vq, text = t2i_inputs(g)
    single_sampler(g, ar, vq, text, "FastARSamplerSJD", sampler_widgets(seed=42, cfg=7.5) + [32, "random", "gumbel"],
                   "FastAR_llamagen_t2i")
    g.note(below(text),
           f"LlamaGen text-to-image with SJD.\n\nDownload into ComfyUI/models/fastar/:\n- {LLAMAGEN_T2I} "
           f"(or t2i_XL_stage2_512.pt) and {LLAMAGEN_VQ_T2I} from the LlamaGen release "
           "(FoundationVision/LlamaGen on Hugging Face)\n- the google/flan-t5-xl repository as a folder "
           "named flan-t5-xl (models/fastar or models/text_encoders)\nthen press R. Official setting: "
           "cfg 7.5.", width=320, height=250)
    return g.to_json()


LANTERN = {"lantern_k": 1000, "lantern_delta": 0.1, "gamma": 4}
DRAFTS = "sampled"  # the drafter's proposals: a draw from its distribution (the pack's default)
TREE = "chain"  # what the drafter drafts per forward (the pack's default)
LAMBDA = 0.0  # LANTERN++'s bound: off, delta applies


def mar_widgets(num_iter=64, diffusion_steps=100, cfg_schedule="linear"):
    return [num_iter, diffusion_steps, cfg_schedule]


def cspd_widgets(seed=7, cfg=3.0, temperature=1.0, batch=1, gamma=8, prefill=0.05, verify="steps", ratio_temperature=1.0,
                 path_factor=False, **mar):
    return [seed, "fixed", cfg, temperature, batch, gamma, prefill, verify, *mar_widgets(**mar), ratio_temperature,
            path_factor]


DEMO_MAR_SETTINGS = dict(num_iter=32, diffusion_steps=50)


def demo_mar_cspd(info) -> dict:
    g = Graph(info)
    ar, vae = loaders(g, DEMO_MAR, DEMO_KL)
    label = fed_by_model(g, ar, "FastARClassLabel", below(vae), ["ring (demo 5)", -1])
    drafter = fed_by_model(g, ar, "FastARLoadDrafter", below(label), [DEMO_MAR_DRAFT, "auto"])
    g.note(below(drafter),
           "MAR (continuous tokens, a diffusion head per token) on the bundled demo MAR, its KL "
           "autoencoder and its small draft MAR: plain MAR sampling against continuous speculative "
           "decoding (CSpD), same class and seed.\n\nverify = steps is lossless: exactly plain MAR at "
           "the same settings (a given seed gives a different image). verify = merged is the CSpD "
           "paper's scheme: fewer model calls, exactly MAR with each draft round merged into one "
           "step (fewer, larger steps).\n\nEach Stats node takes the MAR stats as baseline: measured speed-up, "
           "model and draft calls, and how many drafted tokens the model accepted.",
           width=320, height=380)
    columns = [("FastARSamplerAR", "MAR (baseline)", sampler_widgets(seed=3, cfg=3.0) + mar_widgets(**DEMO_MAR_SETTINGS)),
               ("FastARSamplerCSpD", "CSpD, verify steps (lossless)",
                cspd_widgets(seed=3, verify="steps", **DEMO_MAR_SETTINGS)),
               ("FastARSamplerCSpD", "CSpD, verify merged (paper)",
                cspd_widgets(seed=3, verify="merged", **DEMO_MAR_SETTINGS))]
    drafter_columns(g, ar, vae, label, drafter, columns, decode_y=720)
    return g.to_json()


def lazymar_widgets(seed=3, cfg=3.0, temperature=1.0, batch=1, start_percent=0.1, end_percent=1.0, refresh_every=4,
                    token_reuse=0.75, head_refresh_every=7, **mar):
    return [seed, "fixed", cfg, temperature, batch, *mar_widgets(**mar), start_percent, end_percent, refresh_every,
            token_reuse, head_refresh_every]


def demo_mar_lazy(info) -> dict:
    g = Graph(info)
    ar, vae = loaders(g, DEMO_MAR, DEMO_KL)
    label = fed_by_model(g, ar, "FastARClassLabel", below(vae), ["square (demo 1)", -1])
    g.note(below(label),
           "Plain MAR against LazyMAR-style feature reuse on the bundled demo MAR, same class and seed.\n\nBetween "
           "full steps (one every refresh_every, after the first start_percent of the steps), a step computes the "
           "class-guided branch only, encodes only the tokens fixed since the step before and recomputes the later "
           "decoder blocks only for the tokens that changed most (token_reuse: the share taken from the cache); the "
           "diffusion head computes one reverse step in head_refresh_every in full and reuses it in between. "
           "Relaxed: the image differs from plain MAR's at the same seed, by design.\n\nThe Stats node takes the "
           "MAR stats as baseline: measured speed-up and the share of the transformer's work done.",
           width=320, height=380)
    columns = [("FastARSamplerAR", "MAR (baseline)", sampler_widgets(seed=3, cfg=3.0) + mar_widgets(**DEMO_MAR_SETTINGS)),
               ("FastARSamplerLazyMAR", "LazyMAR (relaxed)", lazymar_widgets(**DEMO_MAR_SETTINGS))]
    drafter_columns(g, ar, vae, label, None, columns, decode_y=720)
    return g.to_json()


def mar_official(info) -> dict:
    g = Graph(info)
    ar, vae = loaders(g, MAR_HUGE, MAR_KL16)
    label = fed_by_model(g, ar, "FastARClassLabel", below(vae), ["golden retriever (207)", -1])
    drafter = fed_by_model(g, ar, "FastARLoadDrafter", below(label), [MAR_BASE, "auto"])
    sampler, _ = single_sampler(g, ar, vae, label, "FastARSamplerCSpD", cspd_widgets(seed=42, cfg=3.2),
                                "FastAR_mar_cspd")
    g.connect(drafter, "drafter", sampler, "drafter")
    g.note(below(drafter),
           f"MAR-H with continuous speculative decoding, MAR-B drafting.\n\nFrom the MAR release "
           "(the LTH14/mar README's download script): save "
           f"mar/mar_huge/checkpoint-last.pth as ComfyUI/models/fastar/{MAR_HUGE}, "
           f"vae/kl16.ckpt as models/fastar/{MAR_KL16}, and mar/mar_base/checkpoint-last.pth as "
           f"models/fastar_drafters/{MAR_BASE}; then press R.\n\nverify = steps is lossless (exactly "
           "plain MAR-H at these settings). Settings: 64 steps, 100 diffusion steps, cfg 3.2 with the "
           "linear schedule (MAR-H's evaluation setting; it reports its best FID at 256 steps).",
           width=320, height=330)
    return g.to_json()


def drafter_columns(g: Graph, ar, decoder, conditioner, drafter, columns, decode_y: int, baseline=None,
                    first_column: int = 0) -> list:
    """One column per ``(sampler kind, title, widgets)``: sampler, decode, stats and image, the drafter into
    the samplers that take one, and the ``baseline`` sampler's stats (default: the first column's) as every
    other column's baseline. ``decode_y`` clears the tallest sampler and its live preview. The samplers."""
    samplers = []
    for i, (kind, title, widgets) in enumerate(columns, start=first_column):
        x = 360 + i * 380
        sampler = g.node(kind, (x, 0), widgets, title=f"Sampler: {title}", width=340)
        decode = g.node("FastARVQDecode", (x, decode_y), [], width=340)
        stats = g.node("FastARStats", below(decode), [], title=f"Stats: {title}", width=340)
        image = g.node("PreviewImage", below(stats), [], title=f"Image: {title}", width=340)
        wire_sampler(g, ar, decoder, conditioner, sampler, decode, stats)
        g.connect(decode, "image", image, "images")
        if drafter is not None and has_input(sampler, "drafter"):
            g.connect(drafter, "drafter", sampler, "drafter")
        if baseline is None:
            baseline = sampler
        else:
            g.connect(baseline, "stats", stats, "ar_baseline")
        g.group(title, (x - 10, -40, 360, 1500))
        samplers.append(sampler)
    return samplers


def demo_lantern_compare(info) -> dict:
    g = Graph(info)
    ar, vq = loaders(g, "demo_c2i.safetensors", "demo_vq.safetensors")
    label = fed_by_model(g, ar, "FastARClassLabel", below(vq), ["ring (demo 5)", -1])
    drafter = fed_by_model(g, ar, "FastARLoadDrafter", below(label), [DEMO_DRAFTER, "auto"])
    g.note(below(drafter),
           "Drafter speculative decoding on the bundled demo model with the bundled demo drafter (an "
           "EAGLE head, LANTERN's format), same class and seed in every column.\n\nSpeculative is "
           "lossless: the drafter proposes gamma tokens, the model keeps exactly what it would sample "
           "(a given seed still gives a different image than AR). LANTERN and GSD are relaxed: they "
           "trade fidelity for speed by also accepting drafts close to the model's choice. LANTERN "
           "with delta 0 is exactly Speculative.\n\nEach Stats node takes the AR stats as baseline "
           "and shows the measured speed-up, the model forwards and the drafter forwards and time.",
           width=320, height=380)
    columns = [("FastARSamplerAR", "AR (baseline)", []),
               ("FastARSamplerSpeculative", "Speculative (lossless)", [LANTERN["gamma"], DRAFTS, TREE]),
               ("FastARSamplerLANTERN", "LANTERN (relaxed)", [*LANTERN.values(), *SJD.values(), DRAFTS, TREE, LAMBDA]),
               ("FastARSamplerGSD", "GSD (relaxed)", [*SJD.values(), 10, 0.15, 0.5, LANTERN["gamma"]])]
    drafter_columns(g, ar, vq, label, drafter, [(kind, title, sampler_widgets(seed=3) + extra)
                                                for kind, title, extra in columns], decode_y=760)
    return g.to_json()


def lantern_with_drafter(g: Graph, ar, vq, conditioner, drafter_name: str, widgets, prefix: str):
    """One LANTERN sampler (``widgets``: the common sampler widgets) fed by a Load Drafter of ``drafter_name``,
    which goes under the conditioner. The Load Drafter."""
    drafter = fed_by_model(g, ar, "FastARLoadDrafter", below(conditioner), [drafter_name, "auto"])
    sampler, _ = single_sampler(g, ar, vq, conditioner, "FastARSamplerLANTERN",
                                widgets + [*LANTERN.values(), *SJD.values(), DRAFTS, TREE, LAMBDA], prefix)
    g.connect(drafter, "drafter", sampler, "drafter")
    return drafter


def llamagen_t2i_lantern(info) -> dict:
    g = Graph(info)
    ar, vq, text = t2i_inputs(g)
    drafter = lantern_with_drafter(g, ar, vq, text, LANTERN_DRAFTER_T2I,
                                   sampler_widgets(seed=42, cfg=7.5, top_k=1000), "FastAR_llamagen_t2i_lantern")
    g.note(below(drafter),
           f"LlamaGen text-to-image with LANTERN and LANTERN's released drafter.\n\nDownload into "
           f"ComfyUI/models/fastar/: {LLAMAGEN_T2I} and {LLAMAGEN_VQ_T2I} from the LlamaGen release "
           "(FoundationVision/LlamaGen on Hugging Face; the HF folder LlamaGen-T2I works too), and "
           "google/flan-t5-xl as a folder named flan-t5-xl.\nDownload the drafter jadohu/llamagen_drafter "
           f"as a folder named {LANTERN_DRAFTER_T2I.rstrip('/')} (config.json, pytorch_model.bin) into "
           "ComfyUI/models/fastar_drafters/, then press R.\n\nLANTERN is relaxed: delta trades fidelity "
           "for speed (0 = exact speculative decoding). Settings: cfg 7.5, top-k 1000, k 1000, delta 0.1.",
           width=320, height=330)
    return g.to_json()


def text_inputs(g: Graph, model: str, decoder: str, prompt: str):
    """Loaders and a prompt read by the model's own tokenizer (Lumina-mGPT, Anole, Janus-Pro)."""
    ar, vq = loaders(g, model, decoder)
    text = fed_by_model(g, ar, "FastARTextConditioning", below(vq), [prompt, NO_T5], width=320)
    return ar, vq, text


def demo_text_compare(info) -> dict:
    g = Graph(info)
    ar, vq, text = text_inputs(g, DEMO_TEXT, DEMO_VQGAN, "a red ring on a cyan background")
    g.note(below(text),
           "Text-to-image on the bundled text demo (a tiny Lumina-mGPT-format model with its own "
           "tokenizer, no download): AR vs SJD vs GSD on the same prompt and seed.\n\nPrompts name a "
           "colour, a shape and the background colour: circle, square, triangle, stripes, checkerboard, "
           "ring, cross, blob; black, blue, green, cyan, red, magenta, yellow, white.\n\nSJD is lossless, "
           "GSD relaxed; their stats take AR's as baseline.", width=320, height=300)
    columns = [("FastARSamplerAR", "AR (baseline)", []),
               ("FastARSamplerSJD", "SJD (lossless)", [16, "random", "independent"]),
               ("FastARSamplerGSD", "GSD (relaxed)", [16, "random", "independent", 10, 0.15, 0.5])]
    drafter_columns(g, ar, vq, text, None, [(kind, title, sampler_widgets(seed=3, cfg=2.0) + extra)
                                            for kind, title, extra in columns], decode_y=720)
    return g.to_json()


def lumina_mgpt(info) -> dict:
    g = Graph(info)
    ar, vq, text = text_inputs(g, LUMINA_768, CHAMELEON_VQGAN,
                               "A majestic lighthouse on a rocky cliff at sunset, waves crashing below.")
    columns = [("FastARSamplerSJD", "SJD, gumbel coupling (lossless)", [32, "random", "gumbel"]),
               ("FastARSamplerGSD", "GSD (relaxed)", [32, "random", "gumbel", 10, 0.15, 0.5])]
    drafter_columns(g, ar, vq, text, None, [(kind, title, sampler_widgets(seed=42, cfg=3.0, top_k=2000) + extra)
                                            for kind, title, extra in columns], decode_y=720)
    g.note(below(text),
           f"Lumina-mGPT 7B at 768 px with SJD (gumbel coupling, the SCD paper's) and GSD.\n\nDownload "
           f"Alpha-VLLM/Lumina-mGPT-7B-768 as a folder named {LUMINA_768.rstrip('/')} (config.json, the "
           "safetensors shards and their index, the tokenizer files) into ComfyUI/models/fastar/, and "
           f"Meta's Chameleon tokenizer/vqgan.ckpt (with vqgan.yaml) as models/fastar/{CHAMELEON_VQGAN}; "
           "then press R. The 512 and 1024 releases work the same (the size is read from the folder "
           "name). Official settings: cfg 3.0, top-k 2000.", width=320, height=330)
    return g.to_json()


def anole_lantern(info) -> dict:
    g = Graph(info)
    ar, vq, text = text_inputs(g, ANOLE_7B, CHAMELEON_VQGAN, "A red fox curled up asleep in fresh snow, soft morning light.")
    drafter = lantern_with_drafter(g, ar, vq, text, LANTERN_DRAFTER_ANOLE,
                                   sampler_widgets(seed=42, cfg=3.0, top_k=2000), "FastAR_anole_lantern")
    g.note(below(drafter),
           f"Anole 7B (512 px, 32 x 32 tokens) with LANTERN and LANTERN's released Anole drafter.\n\n"
           f"Download leloy/Anole-7b-v0.1-hf (GAIR's Anole in transformers' layout: config.json, the "
           f"safetensors shards and their index, the tokenizer files) as a folder named "
           f"{ANOLE_7B.rstrip('/')} into ComfyUI/models/fastar/, and Anole's (Chameleon's) "
           f"tokenizer/vqgan.ckpt with vqgan.yaml as models/fastar/{CHAMELEON_VQGAN}.\nDownload the drafter "
           f"jadohu/anole_drafter as a folder named {LANTERN_DRAFTER_ANOLE.rstrip('/')} (config.json + "
           "weights) into ComfyUI/models/fastar_drafters/, then press R.\n\nLANTERN is relaxed: delta "
           "trades fidelity for speed (0 = exact speculative decoding). Settings: cfg 3, top-k 2000, "
           "k 1000, delta 0.1.", width=320, height=360)
    return g.to_json()


def janus_pro(info) -> dict:
    g = Graph(info)
    ar, vq, text = text_inputs(g, JANUS_PRO_7B, JANUS_PRO_7B, "A cozy cabin in a snowy forest at dusk, warm light "
                                                                "in the windows.")
    single_sampler(g, ar, vq, text, "FastARSamplerSJD", sampler_widgets(seed=42, cfg=5.0) + [32, "random", "gumbel"],
                   "FastAR_janus_pro")
    g.note(below(text),
           f"Janus-Pro 7B (384 px) with SJD.\n\nDownload deepseek-ai/Janus-Pro-7B (or Janus-Pro-1B) as a "
           f"folder named {JANUS_PRO_7B.rstrip('/')} into ComfyUI/models/fastar/ (its VQ decoder is inside "
           "the checkpoint: pick the same folder in the image decoder loader); transformers' converted "
           "Janus folders work too. Then press R. Official settings: cfg 5, temperature 1, no top-k.",
           width=320, height=260)
    return g.to_json()


def emu3(info) -> dict:
    g = Graph(info)
    ar, vq, text = text_inputs(g, EMU3_GEN_HF, EMU3_GEN_HF, "A lighthouse on a rocky coast at sunset, waves crashing "
                                                            "below, warm golden light.")
    single_sampler(g, ar, vq, text, "FastARSamplerSJD", sampler_widgets(seed=42, cfg=3.0, top_k=2048) + [16, "random",
                   "independent"], "FastAR_emu3")
    g.note(below(text),
           f"Emu3-Gen 8B at 720 px (90 x 90 tokens) with SJD at the SJD reference's settings: window 16, random "
           "init, top-k 2048, cfg 3.0.\n\nDownload BAAI/Emu3-Gen-hf (transformers' layout) as a folder named "
           f"{EMU3_GEN_HF.rstrip('/')} into ComfyUI/models/fastar/ and pick the same folder as the image decoder "
           f"(its VQ model is inside). BAAI's own layout works too: BAAI/Emu3-Gen as {EMU3_GEN.rstrip('/')} and "
           f"BAAI/Emu3-VisionTokenizer as {EMU3_VISION_TOKENIZER.rstrip('/')}, the image decoder. Then press R."
           "\n\nAn empty negative prompt is BAAI's published one. The Load AR Model's aspect_ratio draws "
           "other shapes at the same area. In bf16 the 8B model and its KV cache take about 19 GB; weight_dtype "
           "int8 about 12 GB.",
           width=320, height=330)
    return g.to_json()


def infinity_inputs(g: Graph, model: str, vae: str, prompt: str):
    """Load AR Model at 1024 px, 1:1 (Infinity's 1M-pixel schedule), its BSQ VAE and the prompt through FLAN-T5-XL."""
    ar = g.node("FastARLoadModel", (0, 0), [model, "auto", "1024", "auto", "auto", "1:1"])
    vae_node = g.node("FastARLoadVQ", below(ar), [vae, "auto"])
    text = fed_by_model(g, ar, "FastARTextConditioning", below(vae_node), [prompt, FLAN_T5], width=320)
    return ar, vae_node, text


INFINITY_DOWNLOAD = ("the google/flan-t5-xl repository as a folder named flan-t5-xl (models/fastar or "
                     "models/text_encoders), then press R")


def infinity_2b(info) -> dict:
    g = Graph(info)
    ar, vae, text = infinity_inputs(g, INFINITY_2B, INFINITY_VAE_2B, "A lighthouse on a rocky coast at sunset, waves "
                                                                   "crashing below, warm golden light.")
    # the release's sampling (InfinityModel.release_defaults): cfg 3, tau 0.5, top-k 900, top-p 0.97
    single_sampler(g, ar, vae, text, "FastARSamplerAR", sampler_widgets(seed=42, cfg=3.0, temperature=0.5, top_k=900,
                                                                        top_p=0.97), "FastAR_infinity_2b")
    g.note(below(text),
           f"Infinity-2B (bitwise next-scale text-to-image) at 1024 px, 1:1: 13 scales, one forward each.\n\n"
           f"Download from FoundationVision/Infinity on Hugging Face into ComfyUI/models/fastar/:\n- {INFINITY_2B}\n"
           f"- {INFINITY_VAE_2B}\nand {INFINITY_DOWNLOAD}.\n\nThe VAE goes into the sampler too: each scale's bits "
           "become the next scale's input through it. aspect_ratio on the loader picks the release's template "
           "(1:1 to 3:1 and 1:3); image_size 256/512/768 its smaller schedules. The release's settings: cfg 3, "
           "temperature (tau) 0.5, top-k 900, top-p 0.97.\n\nMemory at 1024 px: about 9.9 GB in bf16 (4.4 GB of "
           "weights, 5.5 GB of KV cache per image with CFG); weight_dtype int8 on the loader about 7.8 GB.",
           width=320, height=340)
    return g.to_json()


def infinity_8b(info) -> dict:
    g = Graph(info)
    ar, vae, text = infinity_inputs(g, INFINITY_8B, INFINITY_VAE_8B, "A red fox curled up asleep in fresh snow, soft "
                                                                   "morning light.")
    # the 8B's release notebooks sample at tau 1.0 (InfinityModel.release_defaults), cfg 3, top-k 900, top-p 0.97
    single_sampler(g, ar, vae, text, "FastARSamplerAR", sampler_widgets(seed=42, cfg=3.0, temperature=1.0, top_k=900,
                                                                        top_p=0.97), "FastAR_infinity_8b")
    g.note(below(text),
           f"Infinity-8B at 1024 px, 1:1: 13 scales, one forward each.\n\nDownload from FoundationVision/Infinity "
           f"on Hugging Face into ComfyUI/models/fastar/:\n- the folder {INFINITY_8B.rstrip('/')} (its "
           f"safetensors shards and model.safetensors.index.json), as a folder\n- {INFINITY_VAE_8B}\nand "
           f"{INFINITY_DOWNLOAD}.\n\nThe VAE goes into the sampler too. Settings of the release's 8B notebooks: "
           "cfg 3, temperature (tau) 1.0, top-k 900, top-p 0.97.\n\nMemory at 1024 px: about 28.8 GB in bf16 "
           "(16.8 GB of weights, 12.1 GB of KV cache per image with CFG); weight_dtype int8 on the loader about "
           "20.6 GB.", width=320, height=340)
    return g.to_json()


# a workflow on the bundled demo files alone is named fastar_demo_*, and every other name sorts after those: the
# template browser, sorted by name, lists the demos first (tests/comfyui/test_comfyui_browser.py)
WORKFLOWS = {
    "fastar_demo_sjd": demo_sjd,
    "fastar_demo_speed_dial": demo_speed_dial,
    "fastar_demo_compare_ar_sjd_gsd": compare,
    "fastar_demo_zipar_compare": demo_zipar_compare,
    "fastar_llamagen_c2i": llamagen_c2i,
    "fastar_llamagen_t2i": llamagen_t2i,
    "fastar_demo_lantern_compare": demo_lantern_compare,
    "fastar_llamagen_t2i_lantern": llamagen_t2i_lantern,
    "fastar_demo_mar_cspd": demo_mar_cspd,
    "fastar_demo_mar_lazy": demo_mar_lazy,
    "fastar_mar_cspd": mar_official,
    "fastar_llamagen_dd": llamagen_dd,
    "fastar_demo_dd_compare": demo_dd_compare,
    "fastar_demo_var_compare": demo_var_compare,
    "fastar_var_d30": var_official,
    "fastar_var_dd_d24": var_dd_official,
    "fastar_demo_text_compare": demo_text_compare,
    "fastar_lumina_mgpt_768": lumina_mgpt,
    "fastar_janus_pro": janus_pro,
    "fastar_lantern_anole": anole_lantern,
    "fastar_emu3_720": emu3,
    "fastar_infinity_2b": infinity_2b,
    "fastar_infinity_8b": infinity_8b,
}


def write_all(info: dict, out: Path = OUT) -> list[Path]:
    out.mkdir(exist_ok=True)
    paths = []
    for name, build in WORKFLOWS.items():
        path = out / f"{name}.json"
        path.write_text(json.dumps(build(info), indent=1) + "\n")
        paths.append(path)
    return paths


# a returning user's settings (a new user's first page opens the template browser), no canvas info or
# minimap, and text drawn at any zoom (a thumbnail of a large graph is drawn small)
THUMBNAIL_SETTINGS = {"Comfy.TutorialCompleted": True, "Comfy.Graph.CanvasInfo": False, "Comfy.Minimap.Visible": False,
                      "LiteGraph.Canvas.MinFontSizeForLOD": 0}

if __name__ == "__main__":
    import subprocess

    with tempfile.TemporaryDirectory() as base, \
            harness.Server(Path(base), settings=THUMBNAIL_SETTINGS) as server:
        for p in write_all(server.object_info()):
            print(f"wrote {p.relative_to(harness.ROOT)}", file=sys.stderr)
            if "--thumbnails" in sys.argv:
                subprocess.run([sys.executable, str(Path(__file__).with_name("browser.py")), "thumbnail", "--url",
                                server.url, "--workflow", str(p), "--out", str(p.with_suffix(".jpg"))], check=True)
