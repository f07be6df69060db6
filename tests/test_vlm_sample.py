"""`mmtrain sample` on VLM runs: answers about images as JSON lines, from a real `mmcache encode`
store (tiny SigLIP + tiny BPE tokenizer, in-process cluster) and real `mmtrain fit` runs.

The images go through the run's ViT exactly as `mmcache encode` prepared them (the cached
features come back bit for bit), the prompt through the store's tokenizer and template (a
caption's start is the training sample's own); greedy answers are the argmax of the model's full
forward step by step (which checks the KV cache too); sampled answers are the same bytes for the
same seed; each seed continues from the prompt decoded once (a fork of its KV cache) exactly as if
the prompt were decoded again; a question without an image is answered from the text alone; a run
whose ViT trained answers with the trained ViT, from the run, a checkpoint or an export alike; bad
input (no image and no question, an unknown or absent device) is a clear error."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist
from click.testing import CliRunner

from mmcache import featstore
from mmcache.featstore.config import load_config
from tests.joint_store import dataset, encode
from mmcache.train.config import TrainConfig
from mmcache.train.trainer import fit


def train(store: str, out: Path, steps: int, *sets: str) -> Path:
    config = load_config(TrainConfig, "tiny-vlm", "train", ["log_every=1", *sets])
    try:
        fit(config, store, str(out), steps=steps, log=lambda *_: None)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    return out


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("vlmsample")
    data = dataset(root / "data", images=8, videos=0)
    store = encode(data, root / "store", preset="tiny-vlm")
    images = sorted(str(p) for p in (root / "data" / "media").glob("*.png"))[:2]
    # 30 steps: enough for answers that depend on the image and the prompt (a check of greedy
    # decoding against the full forward means little on an untrained model's constant output).
    run = train(store, root / "run", 30, "checkpoint.every=10")
    return {"root": root, "store": store, "images": images, "run": run}


def mmtrain(*args: str, check: bool = True):
    from mmcache.train.cli import cli

    result = CliRunner().invoke(cli, list(args))
    if check:
        assert result.exit_code == 0, result.output
    return result


def answers(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "answers.jsonl").read_text().splitlines()]


def test_kv_cache_logits_equal_the_full_forward():
    from mmcache.train.models.llm import Decoder, DecoderConfig, KVCache

    for kv_heads, bias in ((2, False), (4, True)):
        torch.manual_seed(0)
        decoder = Decoder(DecoderConfig(vocab_size=50, dim=32, depth=2, heads=4, kv_heads=kv_heads, mlp_dim=64, qkv_bias=bias)).eval()
        ids = torch.randint(0, 50, (1, 9), generator=torch.Generator().manual_seed(1))
        with torch.no_grad():
            full = decoder(ids)[0]
            cache = KVCache(2)
            steps = [decoder.decode_logits(decoder.embed_tokens(ids[:, :5]), cache)]  # a prompt, then a token at a time
            steps += [decoder.decode_logits(decoder.embed_tokens(ids[:, i : i + 1]), cache) for i in range(5, 9)]
        assert cache.length == 9
        for position, logits in zip(range(4, 9), steps, strict=True):
            assert torch.allclose(logits[0], full[position], atol=1e-5, rtol=0)
        # A fork continues the prompt's cache on its own: two continuations of one prefix, each
        # as if decoded alone, and the prefix is left at the prompt.
        other = torch.randint(0, 50, (1, 4), generator=torch.Generator().manual_seed(2))
        with torch.no_grad():
            prefix = KVCache(2)
            decoder.decode_logits(decoder.embed_tokens(ids[:, :5]), prefix)
            for continuation in (ids[:, 5:], other):
                fork = prefix.fork()
                last = [decoder.decode_logits(decoder.embed_tokens(continuation[:, i : i + 1]), fork) for i in range(4)][-1]
                alone = decoder(torch.cat([ids[:, :5], continuation], dim=1))[0, -1]
                assert fork.length == 9 and torch.allclose(last[0], alone, atol=1e-5, rtol=0)
        assert prefix.length == 5


def test_greedy_answers_are_the_models_argmax_step_by_step(setup):
    from mmcache.train.live.reattach import sample_rows
    from mmcache.train.data.packing import expand_sample, pack
    from mmcache.train.sample.source import load_trained, reattach_trained

    out = setup["root"] / "greedy"
    result = mmtrain("sample", "--run", str(setup["run"]), *[a for i in setup["images"] for a in ("--image", i)], "--prompt", "describe the image",
                     "--prompt", "what is this", "--out", str(out), "--max-new-tokens", "8")
    assert "4 answer(s) in answers.jsonl" in result.output
    rows = answers(out)
    assert [(Path(r["image"]).name, r["prompt"]) for r in rows] == [(Path(i).name, p) for i in setup["images"] for p in ("describe the image", "what is this")]
    store = featstore.open(setup["store"])
    trained = load_trained(setup["run"])
    vit, tokenizer = reattach_trained(trained, store, "vit_features"), reattach_trained(trained, store, "input_ids").encoder
    meta = store.fields["input_ids"].meta
    # The images prepared and encoded as mmcache encode did: the cached features, bit for bit.
    by_source = {row["source_uri"]: row["id"] for row in sample_rows(store, store.sample_ids())}
    features = vit.encode_files(setup["images"])
    for path, array in zip(setup["images"], features, strict=True):
        assert np.array_equal(array.view(np.uint16), store.read(by_source[path])["vit_features"].view(np.uint16))
    # A caption's prompt is the training sample's tokens before its first answer token.
    sample = store.read(by_source[setup["images"][0]])
    assert tokenizer.generation_prompt(None).tolist() == sample["input_ids"][: int(np.argmax(sample["target_mask"]))].tolist()
    stop = tokenizer.stop_token_ids()
    for row in rows:
        prompt = tokenizer.generation_prompt(row["prompt"])
        image = features[setup["images"].index(row["image"])]
        for i in range(len(row["tokens"]) + (row["finish"] == "stop")):
            ids = np.concatenate([prompt, np.asarray(row["tokens"][:i], dtype=np.int32)])
            batch = pack([expand_sample("x", ids, np.zeros(len(ids)), image, image_token_id=meta["image_token_id"],
                                        image_tokens=trained.model.config.image_tokens, vocab_size=meta["vocab_size"])], len(ids) + 64)
            with torch.no_grad():
                logits = trained.model(batch)[0, int((batch.document_ids[0] >= 0).sum()) - 1]
            expected = row["tokens"][i] if i < len(row["tokens"]) else stop
            assert (int(logits.argmax()) in stop) if i == len(row["tokens"]) else int(logits.argmax()) == expected
        assert row["answer"] == tokenizer.decode(row["tokens"]) and row["seed"] is None


def test_text_only_questions_are_answered_from_the_text_alone(setup):
    from mmcache.train.data.packing import expand_sample, pack
    from mmcache.train.sample.source import load_trained, reattach_trained

    root, run = setup["root"], str(setup["run"])
    questions = ["what is this", "tell me about it"]
    args = [a for q in questions for a in ("--prompt", q)]
    result = mmtrain("sample", "--run", run, *args, "--max-new-tokens", "8", "--out", str(root / "text"))
    assert "2 answer(s) in answers.jsonl" in result.output
    rows = answers(root / "text")
    assert [(r["image"], r["prompt"], r["seed"]) for r in rows] == [(None, q, None) for q in questions]
    # Greedy: the argmax of the model's full forward on the image-less prompt, step by step.
    store = featstore.open(setup["store"])
    trained = load_trained(setup["run"])
    tokenizer = reattach_trained(trained, store, "input_ids").encoder
    meta = store.fields["input_ids"].meta
    stop = tokenizer.stop_token_ids()
    for row in rows:
        prompt = tokenizer.generation_prompt(row["prompt"], images=0)
        assert meta["image_token_id"] not in prompt.tolist()
        for i in range(len(row["tokens"]) + (row["finish"] == "stop")):
            ids = np.concatenate([prompt, np.asarray(row["tokens"][:i], dtype=np.int32)])
            batch = pack([expand_sample("x", ids, np.zeros(len(ids)), None, image_token_id=meta["image_token_id"],
                                        image_tokens=trained.model.config.image_tokens, vocab_size=meta["vocab_size"])], len(ids))
            with torch.no_grad():
                predicted = int(trained.model(batch)[0, -1].argmax())
            assert predicted in stop if i == len(row["tokens"]) else predicted == row["tokens"][i]
    # Sampled: the same bytes for the same seeds, with --device cpu named or not.
    sampled = [*args, "--temperature", "1.0", "--seed", "1", "--seed", "2", "--max-new-tokens", "8"]
    mmtrain("sample", "--run", run, *sampled, "--out", str(root / "text-s1"))
    mmtrain("sample", "--run", run, *sampled, "--device", "cpu", "--out", str(root / "text-s2"))
    assert (root / "text-s1" / "answers.jsonl").read_bytes() == (root / "text-s2" / "answers.jsonl").read_bytes()
    assert [(r["prompt"], r["seed"]) for r in answers(root / "text-s1")] == [(q, s) for q in questions for s in (1, 2)]


def test_each_seed_continues_the_prompts_cache_as_if_decoded_again(setup):
    from mmcache.train.sample.answer import AnswerConfig, continue_answer, prefill
    from mmcache.train.sample.source import load_trained, reattach_trained

    root = setup["root"]
    seeds = ["--seed", "1", "--seed", "2", "--seed", "3"]
    mmtrain("sample", "--run", str(setup["run"]), "--image", setup["images"][1], "--prompt", "what is this", "--temperature", "1.0",
            *seeds, "--max-new-tokens", "10", "--out", str(root / "forked"))
    rows = answers(root / "forked")
    assert len({tuple(r["tokens"]) for r in rows}) > 1  # the seeds draw differently: a shared cache would show
    store = featstore.open(setup["store"])
    trained = load_trained(setup["run"])
    vit, tokenizer = reattach_trained(trained, store, "vit_features"), reattach_trained(trained, store, "input_ids").encoder
    image = vit.encode_files([setup["images"][1]])[0]
    prompt, meta, stop = tokenizer.generation_prompt("what is this"), store.fields["input_ids"].meta, tokenizer.stop_token_ids()
    config = AnswerConfig(max_new_tokens=10, temperature=1.0)
    prefix = prefill(trained.model, prompt, image, meta)
    length = prefix.cache.length
    for row in rows:
        # Decoding the prompt again for this seed alone gives this seed's answer ...
        fresh = prefill(trained.model, prompt, image, meta)
        assert continue_answer(trained.model, fresh, stop, config, row["seed"]) == (row["tokens"], row["finish"])
        # ... and so does continuing one prefix seed after seed, which keeps its length.
        assert continue_answer(trained.model, prefix, stop, config, row["seed"]) == (row["tokens"], row["finish"])
        assert prefix.cache.length == length


def test_sampled_answers_are_the_same_bytes_for_the_same_seed_from_a_run_or_its_export(setup):
    root = setup["root"]
    args = ["--image", setup["images"][0], "--temperature", "1.0", "--top-p", "0.9", "--max-new-tokens", "8"]
    mmtrain("sample", "--run", str(setup["run"]), *args, "--seed", "1", "--seed", "2", "--out", str(root / "s1"))
    mmtrain("sample", "--run", str(setup["run"]), *args, "--seed", "1", "--seed", "2", "--out", str(root / "s2"))
    assert (root / "s1" / "answers.jsonl").read_bytes() == (root / "s2" / "answers.jsonl").read_bytes()
    rows = answers(root / "s1")
    assert [r["seed"] for r in rows] == [1, 2] and rows[0]["prompt"] is None  # no --prompt: a caption
    assert rows[0]["tokens"] != rows[1]["tokens"]  # another seed, another draw
    mmtrain("export", str(setup["run"]), "--out", str(root / "export"))
    mmtrain("sample", "--run", str(root / "export"), *args, "--seed", "1", "--seed", "2", "--out", str(root / "s3"))
    assert (root / "s3" / "answers.jsonl").read_bytes() == (root / "s1" / "answers.jsonl").read_bytes()
    mmtrain("sample", "--run", str(setup["run"]), "--checkpoint", "20", *args, "--seed", "1", "--seed", "2", "--out", str(root / "s4"))
    assert (root / "s4" / "answers.jsonl").read_bytes() != (root / "s1" / "answers.jsonl").read_bytes()  # other weights


def test_a_run_that_trained_its_vit_answers_with_the_trained_vit(setup):
    from mmcache.train.sample.source import load_trained, reattach_trained

    root = setup["root"]
    # With a held-out split (3 of the 8, hence a global batch of 4): val_loss reads the held-out
    # samples' images through the training ViT.
    run = train(setup["store"], root / "vit-run", 4, "checkpoint.every=2", "encoders.vit_features.mode=train", "encoders.vit_features.last_blocks=1",
                "data.validation_fraction=0.3", "data.global_batch=4", "sample.every=2", "sample.at_start=true")
    val = {r["step"]: r["val_loss"] for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines()) if "val_loss" in r}
    assert sorted(val) == [0, 2, 4] and all(np.isfinite(list(val.values()))) and val[4] < val[0]
    # The VLM's export and the trained ViT's share RUN/export; both are there.
    assert sorted(p.name for p in (run / "export").iterdir()) == ["llm", "projector", "vit_features"]
    store = featstore.open(setup["store"])
    vit = reattach_trained(load_trained(run), store, "vit_features")
    recorded = store.fields["vit_features"].meta["fingerprint"]
    assert vit.fingerprint()["weights_sha256"] != recorded["weights_sha256"] and set(vit.differences()) == {"weights_sha256"}
    from_checkpoint = reattach_trained(load_trained(run, 4), store, "vit_features")
    assert from_checkpoint.fingerprint()["weights_sha256"] == vit.fingerprint()["weights_sha256"]  # the step-4 state is the final one
    mmtrain("export", str(run), "--out", str(root / "vit-export"))
    args = ["--image", setup["images"][1], "--max-new-tokens", "6"]
    for name, source in (("final", ["--run", str(run)]), ("step4", ["--run", str(run), "--checkpoint", "4"]), ("export", ["--run", str(root / "vit-export")])):
        mmtrain("sample", *source, *args, "--out", str(root / f"vit-{name}"))
    first = (root / "vit-final" / "answers.jsonl").read_bytes()
    assert (root / "vit-step4" / "answers.jsonl").read_bytes() == first and (root / "vit-export" / "answers.jsonl").read_bytes() == first
    assert (root / "vit-export" / "encoders" / "vit_features" / "config.json").is_file()


def test_bad_input_is_a_clear_error(setup):
    root, run = setup["root"], str(setup["run"])
    cases = [
        (["--image", str(root / "nope.png")], f"--image {root / 'nope.png'}: no such file"),
        ([], "this is a VLM run: give the images to answer about with --image PATH (repeatable), or a question with --prompt TEXT"),
        (["--prompt", "<image> what is this"], "the prompt holds 1 <image> placeholder(s) for 0 image(s)"),
        (["--prompt", "what is this", "--device", "tpu"], "device 'tpu': give one of cpu, cuda, npu"),
        (["--prompt", "what is this", "--device", "cpu:1"], "device 'cpu:1': give one of cpu, cuda, npu"),
        (["--image", setup["images"][0], "--top-p", "0.5"], "--top-p applies when sampling: give --temperature > 0"),
        (["--image", setup["images"][0], "--seed", "3"], "--seed applies when sampling"),
        (["--image", setup["images"][0], "--temperature", "-1"], "--temperature must be >= 0"),
        (["--image", str(Path(setup["store"]) / "zarr.json")], "not an image or video file"),
    ]
    if not torch.cuda.is_available():  # a machine without CUDA says so (with one, cuda:N past its count does)
        cases.append((["--prompt", "what is this", "--device", "cuda"], "device 'cuda': no CUDA device here; use --device cpu"))
    cases.append((["--prompt", "what is this", "--device", f"cuda:{torch.cuda.device_count() if torch.cuda.is_available() else 0}"], "device 'cuda:"))
    for extra, message in cases:
        result = mmtrain("sample", "--run", run, *extra, "--out", str(root / "bad"), check=False)
        assert result.exit_code == 1 and message in result.output, (extra, result.output)
    assert not (root / "bad").exists()


def test_devices_by_name():
    from mmcache.train.parallel.dims import DeviceChoiceError, device_and_backend, pick_device

    assert pick_device("cpu") == pick_device(" CPU ") == torch.device("cpu")
    assert pick_device("auto") == device_and_backend()[0]  # the trainer's pick
    if torch.cuda.is_available():
        assert pick_device("cuda") == torch.device("cuda", 0)
    for name in ("gpu", "cuda:x", "auto:0", ""):
        with pytest.raises(DeviceChoiceError, match="give one of cpu, cuda, npu"):
            pick_device(name)
    with pytest.raises(DeviceChoiceError, match="use --device cpu"):
        pick_device("npu:7")  # no torch_npu here, or not 8 NPUs
