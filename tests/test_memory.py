"""Memory planning (memory.py): a run that cannot fit is refused before it starts, saying what needs what and how
many images would fit; images are decoded in chunks sized to the room there is, halved and retried when a chunk
still runs out; the estimates count what a decode really allocates."""
import numpy as np
import pytest
import torch

from fastar import memory
from fastar.errors import FastARError
from fastar.memory import Need, check_room, token_working_bytes
from fastar.model_loaders.shared.demo import DEMO_VQ
from fastar.model_loaders import load_image_decoder
from fastar.pipeline import check_token_room, decode_images
from fastar.samplers.decoders import DecoderSpec
from fastar.samplers.processing import SamplingSettings
from tiny_llamagen import tiny_conditioning, tiny_model

GB = 10**9


def linear_need(batch=4):
    return Need({"model.safetensors": 14 * GB}, lambda images: images * GB, batch)


def test_a_run_that_fits_passes():
    check_room(linear_need(), 20 * GB, "the GPU", dtype=torch.bfloat16)


def test_a_run_too_big_for_its_batch_says_which_batch_fits():
    with pytest.raises(FastARError) as caught:
        check_room(linear_need(), 17 * GB, "the GPU (a 17 GB card)", dtype=torch.bfloat16)
    message = str(caught.value)
    assert "needs about 18.0 GB of memory on the GPU (a 17 GB card) (model.safetensors 14.0 GB, KV caches and " \
           "activations 4.0 GB for 4 image(s) at once), and 17.0 GB is there" in message
    assert "1 image(s) at once fit (15.0 GB): lower the batch" in message  # 15 <= 0.92 * 17 = 15.6 < 16


def test_weights_that_do_not_fit_at_all_advise_half_precision_in_fp32_only():
    with pytest.raises(FastARError, match="not even batch 1 fits \\(15.0 GB\\): load the model in bf16 or fp16"):
        check_room(linear_need(), 12 * GB, "the GPU", dtype=torch.float32)
    with pytest.raises(FastARError) as caught:
        check_room(linear_need(), 12 * GB, "the GPU", dtype=torch.bfloat16)
    assert "not even batch 1 fits" in str(caught.value) and "bf16" not in str(caught.value)


def streamable_need(batch=4):
    """A 7B shape: 14 GB of weights of which 13 GB are blocks that can stream, 0.4 GB streamed at a time."""
    return Need({"model.safetensors": 14 * GB}, lambda images: images * GB, batch, streamable=13 * GB,
                stream_buffer=GB * 4 // 10)


def test_a_run_that_fits_only_with_streamed_blocks_passes_and_says_so():
    assert check_room(streamable_need(), 20 * GB, "the GPU", dtype=torch.bfloat16) is False  # all of it fits
    assert check_room(streamable_need(), 12 * GB, "the GPU", dtype=torch.bfloat16) is True  # 1.4 + 4 GB at least
    assert check_room(linear_need(), 20 * GB, "the GPU", dtype=torch.bfloat16) is False


def test_a_run_too_big_even_streamed_says_what_streaming_leaves_and_which_batch_fits():
    with pytest.raises(FastARError) as caught:
        check_room(streamable_need(batch=8), 8 * GB, "the GPU (an 8 GB card)", dtype=torch.bfloat16)
    message = str(caught.value)
    assert "needs about 22.0 GB" in message and "9.4 GB with the blocks' weights streamed from system memory" in message
    assert "5 image(s) at once fit (6.4 GB)" in message  # 1.4 GB + 5 GB <= 0.92 * 8 = 7.36 < 7.4


def test_the_cli_refuses_a_decode_whose_caches_cannot_fit_beside_the_weights(monkeypatch):
    import fastar.pipeline as pipeline

    model = tiny_model(seed=3)
    rows, sampling, spec = tiny_conditioning(model), SamplingSettings(), DecoderSpec("sjd", window=4)
    one = token_working_bytes(model, rows, 1, True, spec)
    monkeypatch.setattr(pipeline, "free_bytes", lambda device: int(1.5 * one / memory.HEADROOM))
    with pytest.raises(FastARError, match="beside the loaded weights.*1 image\\(s\\) at once fit"):
        check_token_room(model, rows, sampling, spec)  # two rows asked
    monkeypatch.setattr(pipeline, "free_bytes", lambda device: None)  # a CPU: nothing planned
    check_token_room(model, rows, sampling, spec)


def test_working_memory_counts_gsd_clusters_and_lantern_tables_and_grows_with_the_batch():
    model = tiny_model(seed=3)
    rows = tiny_conditioning(model)
    sjd = token_working_bytes(model, rows, 2, True, DecoderSpec("sjd", window=8))
    gsd = token_working_bytes(model, rows, 2, True, DecoderSpec("gsd", window=8, group=9))
    lantern = token_working_bytes(model, rows, 2, True, DecoderSpec("lantern", window=8, lantern_k=50))
    width = model.code_embeddings().shape[-1]
    assert gsd - sjd == 2 * 8 * 10 * width * 4 * 2 and lantern - sjd == model.vocab_size * 50 * 8
    assert token_working_bytes(model, rows, 4, True, DecoderSpec("sjd", window=8)) > sjd


@pytest.fixture(scope="module")
def vq():
    return load_image_decoder(DEMO_VQ)


def same_images(a: np.ndarray, b: np.ndarray) -> bool:
    """Equal up to one level: a convolution's float sums depend on how many images go through it at once."""
    return a.shape == b.shape and int(np.abs(a.astype(int) - b.astype(int)).max()) <= 1


def test_images_are_decoded_in_chunks_sized_to_the_room(vq, monkeypatch):
    codes = torch.randint(0, vq.cfg.codebook_size, (5, 4, 4), generator=torch.Generator().manual_seed(0))
    whole = decode_images(vq, codes, chunk=16)
    per_image = memory.decode_bytes_per_image(vq, (4, 4))
    monkeypatch.setattr(memory, "free_bytes", lambda device: int(2.5 * per_image / memory.HEADROOM))
    assert memory.images_per_chunk(vq, codes) == 2
    sizes = []
    real = vq.decode
    monkeypatch.setattr(vq, "decode", lambda part: sizes.append(len(part)) or real(part))
    assert same_images(decode_images(vq, codes), whole) and sizes == [2, 2, 1]


def test_a_chunk_out_of_memory_is_halved_and_one_image_out_of_memory_says_what_to_do(vq, monkeypatch):
    codes = torch.randint(0, vq.cfg.codebook_size, (5, 4, 4), generator=torch.Generator().manual_seed(0))
    whole = decode_images(vq, codes, chunk=16)
    real, sizes = vq.decode, []

    def tight(part, limit):
        sizes.append(len(part))
        if len(part) > limit:
            raise torch.OutOfMemoryError("CUDA out of memory")
        return real(part)

    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    monkeypatch.setattr(vq, "decode", lambda part: tight(part, 2))
    assert same_images(decode_images(vq, codes, chunk=5), whole) and sizes == [5, 3, 2, 1, 2]
    monkeypatch.setattr(vq, "decode", lambda part: tight(part, 0))
    with pytest.raises(FastARError, match="decoding one image ran out of memory on cpu .*close what else uses the GPU"):
        decode_images(vq, codes, chunk=2)
