"""Large models load shard by shard: a sharded Hugging Face folder is read without touching tensor data, then
goes into the model one tensor at a time (a joined layer's parts together: q, k and v), each cast to the requested
dtype on the requested device as it is read, so that host memory holds the model plus one layer (plus the shard's
mapped pages), never the checkpoint twice. Counted on the reads themselves (a peak-RSS measurement in a process that has just imported torch is
dominated by one-time allocations)."""
import json

import pytest
import torch
from safetensors.torch import save_file

from fastar.model_loaders import load_ar_model
from fastar.model_loaders.shared import checkpoint
from fastar.model_loaders.shared.checkpoint import read_state_dict
from fastar.model_loaders.shared.joined import joined_parts, parted_state_dict
from fastar.tests.tiny_chameleon import hf_model, save_tokenizer, vocabulary


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """A Lumina-mGPT folder in four shards with an index, stored in fp32."""
    folder = tmp_path_factory.mktemp("shards") / "lumina-mgpt"
    folder.mkdir()
    model = hf_model(seed=0)
    sd = {k: v.clone() for k, v in model.state_dict().items()}
    keys, index = sorted(sd), {}
    for s in range(4):
        name = f"model-{s + 1:05d}-of-00004.safetensors"
        save_file({k: sd[k] for k in keys[s::4]}, str(folder / name))
        index.update(dict.fromkeys(keys[s::4], name))
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": index}))
    config = model.config.to_dict()
    config.update(architectures=["ChameleonXLLMXForConditionalGeneration"], image_size=128)
    (folder / "config.json").write_text(json.dumps(config))
    save_tokenizer(folder, vocabulary())
    return folder


@pytest.fixture
def reads(monkeypatch):
    """Every tensor read from a shard, and how many read tensors were not yet in the model at the time."""
    log = {"keys": [], "pending": 0, "most_pending": 0}
    read, assign = checkpoint.ShardedWeights.__getitem__, torch.nn.Module.load_state_dict

    def counting_read(self, key):
        log["keys"].append(key)
        log["pending"] += 1
        log["most_pending"] = max(log["most_pending"], log["pending"])
        return read(self, key)

    def counting_assign(self, state_dict, *args, **kw):
        parts = joined_parts(self)  # a joined weight is read as its parts (q, k and v apart in the checkpoint)
        log["pending"] -= sum(len(parts.get(key, (key,))) for key in state_dict)
        return assign(self, state_dict, *args, **kw)

    monkeypatch.setattr(checkpoint.ShardedWeights, "__getitem__", counting_read)
    monkeypatch.setattr(torch.nn.Module, "load_state_dict", counting_assign)
    return log


def test_reading_a_folder_touches_no_tensor(folder, reads):
    sd, info = read_state_dict(folder)
    assert checkpoint.detect_family(sd) == "chameleon" and len(sd) > 30
    assert reads["keys"] == []


def test_each_tensor_is_read_once_cast_and_placed_before_the_next(folder, reads):
    model = load_ar_model(folder, dtype=torch.bfloat16)
    expected = set(parted_state_dict(model))  # the checkpoint's names
    assert sorted(reads["keys"]) == sorted(expected)  # no tensor read twice, the VQ encoder's never
    assert reads["most_pending"] == 3  # one layer in flight (a joined one's q, k, v): never a dict of the checkpoint
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
