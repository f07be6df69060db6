"""The `tokenizer` encoder through `mmcache encode` (real LocalCluster, real tiny ViT, a BPE
tokenizer trained here): captions and conversations become input_ids / target_mask as the VLM
data contract says; bad text becomes rejects with the reason; the fingerprint follows the files."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import numpy as np
import pytest

from mmcache import featstore
from mmcache.featstore.config import load_config
from mmcache.precompute.config import EncodeConfig
from mmcache.precompute.demo_data import make_dataset
from mmcache.precompute.encoders import EncoderConfigError, TextSample, build_encoder
from mmcache.precompute.encoders.tiny import ensure_tiny_models, train_tiny_bpe_tokenizer
from mmcache.precompute.pipeline import run_encode


@pytest.fixture(scope="module")
def cluster():
    from distributed import Client

    from mmcache.precompute.runtime.local_cluster import local_cluster

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    with local_cluster(2) as cluster, Client(cluster) as client:
        yield cluster.scheduler_address, client


@pytest.fixture(scope="module")
def media(tmp_path_factory) -> Path:
    return make_dataset(tmp_path_factory.mktemp("data"), num_images=6, num_videos=0).parent


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory) -> Path:
    return ensure_tiny_models(tmp_path_factory.mktemp("tiny"), ["tokenizer"])["tokenizer"]


def encode(manifest: Path, out: Path, cluster, *overrides: str, log=lambda *_: None):
    config = load_config(EncodeConfig, "tiny-vlm", "encode", ["run.samples_per_task=4", *overrides])
    return run_encode(config, str(manifest), str(out), scheduler=cluster[0], progress=False, log=log)


def write_manifest(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def decode(tokenizer, ids) -> str:
    return tokenizer.decode([int(i) for i in ids])


def test_captions_and_conversations_end_to_end(media, tmp_path, cluster):
    tok = train_tiny_bpe_tokenizer()
    conversation = [
        {"from": "human", "value": "<image>\nWhat shape is it?"},
        {"from": "gpt", "value": "a red circle"},
        {"from": "human", "value": "And the colour?"},
        {"from": "gpt", "value": "red"},
    ]
    rows = [
        {"path": "media/image_000.png", "caption": "a blue square on a gradient", "id": "cap"},
        {"path": "media/image_001.png", "conversations": conversation, "id": "conv"},
    ]
    out = tmp_path / "store"
    summary = encode(write_manifest(media / "m.jsonl", rows), out, cluster)
    assert summary.samples_written == 2 and summary.rejected == 0
    store = featstore.open(str(out))
    assert sorted(store.fields) == ["input_ids", "target_mask", "vit_features"]
    meta = store.fields["input_ids"].meta
    image_id = meta["image_token_id"]
    assert meta["image_token"] == "<image>" and image_id == tok.convert_tokens_to_ids("<image>")
    assert (meta["bos_token_id"], meta["eos_token_id"], meta["pad_token_id"]) == (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id)
    assert meta["vocab_size"] == len(tok) and meta["fingerprint"]["encoder"] == "tokenizer"

    cap = store.read("cap")
    ids, mask = cap["input_ids"], cap["target_mask"]
    assert ids.dtype == np.int32 and mask.dtype == np.uint8 and ids.shape == mask.shape
    assert decode(tok, ids) == "<s><image>\na blue square on a gradient</s>"
    assert decode(tok, ids[mask == 1]) == "a blue square on a gradient</s>"
    assert (ids == image_id).sum() == 1 and mask[ids == image_id].sum() == 0

    conv = store.read("conv")
    ids, mask = conv["input_ids"], conv["target_mask"]
    text = decode(tok, ids)
    assert text == "<s>USER: <image>\nWhat shape is it?\nASSISTANT: a red circle</s>\nUSER: And the colour?\nASSISTANT: red</s>\n"
    # Exactly the assistant tokens (and their EOS) are targets, in one run per assistant turn.
    runs = np.split(ids, np.flatnonzero(np.diff(mask.astype(int)) != 0) + 1)
    kinds = np.split(mask, np.flatnonzero(np.diff(mask.astype(int)) != 0) + 1)
    answers = [decode(tok, r).strip() for r, k in zip(runs, kinds) if k[0] == 1]
    assert answers == ["a red circle</s>", "red</s>"]
    assert (ids == image_id).sum() == 1 and mask[ids == image_id].sum() == 0
    assert store.read("conv")["vit_features"].shape == store.read("cap")["vit_features"].shape


def test_text_only_samples_and_edited_text_on_a_rerun(media, tmp_path, cluster):
    """Rows without media (a conversation or a caption for the LLM alone) become samples with the
    text fields only (no vit_features: zero image tokens); a placeholder in one is a reject. A
    re-run reports committed samples whose conversations or caption were edited since."""
    tok = train_tiny_bpe_tokenizer()
    chat = [{"from": "human", "value": "Say hello"}, {"from": "gpt", "value": "hello there"}]
    rows = [
        {"path": "media/image_000.png", "caption": "a blue square", "id": "img"},
        {"path": "media/image_001.png", "conversations": [{"from": "human", "value": "<image>\nWhat?"}, {"from": "gpt", "value": "red"}], "id": "imgchat"},
        {"path": None, "conversations": chat, "id": "chat"},
        {"path": "", "caption": "a caption with no picture"},  # no id: one from its text
        {"path": None, "conversations": [{"from": "human", "value": "<image> where?"}, {"from": "gpt", "value": "x"}], "id": "ghost"},
        {"path": None, "id": "empty"},
    ]
    out = tmp_path / "store"
    summary = encode(write_manifest(media / "text.jsonl", rows), out, cluster)
    assert (summary.samples_written, summary.rejected) == (4, 2)
    store = featstore.open(str(out))
    text_id = next(i for i in store.sample_ids() if i.startswith("text-"))
    assert sorted(store.sample_ids()) == sorted(["img", "imgchat", "chat", text_id])
    for sample_id in ("chat", text_id):
        assert sorted(store.fields_of(sample_id)) == ["input_ids", "target_mask"]  # no image field
    assert "vit_features" in store.fields_of("img")
    image_id = store.fields["input_ids"].meta["image_token_id"]
    chat_ids = store.read("chat")["input_ids"]
    assert decode(tok, chat_ids) == "<s>USER: Say hello\nASSISTANT: hello there</s>\n" and image_id not in chat_ids
    caption = store.read(text_id)
    assert decode(tok, caption["input_ids"]) == "<s>a caption with no picture</s>"  # the prompt without its placeholder
    assert decode(tok, caption["input_ids"][caption["target_mask"] == 1]) == "a caption with no picture</s>"
    reasons = {r["id"]: r["reason"] for r in store.rejects.to_pylist()}
    assert "1 <image> placeholder(s) for 0 image(s)" in reasons["ghost"]
    assert "no text" in reasons["empty"]
    row = store.index.to_pylist()[store.row("chat")]
    assert row["modality"] == "text" and row.get("source_uri") is None

    # Edit the text of three committed samples: each is reported, none re-encoded.
    rows[1]["conversations"][1]["value"] = "blue"
    rows[2]["conversations"] = chat + [{"from": "human", "value": "again"}, {"from": "gpt", "value": "hi"}]
    rows[0]["caption"] = "a green square"
    lines: list[str] = []
    summary = encode(write_manifest(media / "text.jsonl", rows), out, cluster, log=lines.append)
    assert summary.samples_written == 0 and summary.stale == 3
    warning = next(line for line in lines if "changed since they were encoded" in line)
    assert "2 conversations changed" in warning and "1 caption changed" in warning and "new ids" in warning
    assert decode(tok, featstore.open(str(out)).read("chat")["input_ids"]).endswith("hello there</s>\n")


def test_text_only_rows_need_the_tokenizer(tmp_path, media, cluster):
    """A DiT config (no tokenizer) has nothing to train on in a caption without its image."""
    from mmcache.precompute.inputs.manifest import read_inputs

    manifest = write_manifest(media / "dit.jsonl", [{"path": "media/image_000.png", "caption": "x"}, {"path": None, "caption": "y"}])
    rows, rejects = read_inputs(str(manifest))
    assert len(rows) == 1 and "text-only rows need the tokenizer" in rejects[0].reason
    rows, rejects = read_inputs(str(manifest), allow_text_only=True)
    assert [r.modality for r in rows] == ["image", "text"] and not rejects
    with pytest.raises(ValueError, match="no 'path' column"):
        read_inputs(str(write_manifest(media / "typo.jsonl", [{"image": "media/image_000.png", "caption": "x"}])), allow_text_only=True)


def test_bad_text_becomes_rejects(media, tmp_path, cluster):
    def conv(*turns):
        return [{"from": who, "value": value} for who, value in turns]

    rows = [
        {"path": "media/image_000.png", "caption": "fine", "id": "ok"},
        {"path": "media/image_001.png", "conversations": conv(("human", "no placeholder"), ("gpt", "x")), "id": "noimg"},
        {"path": "media/image_002.png", "conversations": conv(("human", "<image> <image> two"), ("gpt", "x")), "id": "two"},
        {"path": "media/image_003.png", "conversations": conv(("human", "<image> hello")), "id": "noanswer"},
        {"path": "media/image_004.png", "caption": " ".join(["red circle"] * 100), "id": "long"},
        {"path": "media/image_005.png", "conversations": "[not json", "id": "badjson"},
    ]
    out = tmp_path / "store"
    summary = encode(write_manifest(media / "bad.jsonl", rows), out, cluster, "text.max_length=64")
    assert summary.samples_written == 1
    store = featstore.open(str(out))
    reasons = {r["sample_id"] if "sample_id" in r else r["id"]: r["reason"] for r in store.rejects.to_pylist()}
    expected = {
        "noimg": "has an image but its text has no <image>",
        "two": "2 <image> placeholder(s) for 1 image(s)",
        "noanswer": "no assistant (gpt) turn",
        "long": "> text.max_length=64 (samples are never truncated",
        "badjson": "conversations is not valid JSON",
    }
    assert set(reasons) == set(expected), reasons
    for sample, fragment in expected.items():
        assert fragment in reasons[sample], (sample, reasons[sample])
    assert store.sample_ids() == ["ok"]


def test_missing_or_incomplete_tokenizer_folder_is_a_config_error(tmp_path, tokenizer_dir):
    with pytest.raises(EncoderConfigError, match="not a folder"):
        build_encoder("tokenizer", {"path": str(tmp_path / "nope")})
    partial = tmp_path / "partial"
    partial.mkdir()
    shutil.copy(tokenizer_dir / "tokenizer_config.json", partial)
    with pytest.raises(EncoderConfigError, match="no tokenizer.json"):
        build_encoder("tokenizer", {"path": str(partial)})
    broken = tmp_path / "broken"
    shutil.copytree(tokenizer_dir, broken)
    (broken / "tokenizer.json").write_text("{ truncated")
    with pytest.raises(EncoderConfigError, match="cannot load"):
        build_encoder("tokenizer", {"path": str(broken)}).load("cpu")
    with pytest.raises(EncoderConfigError, match="is not one token"):
        build_encoder("tokenizer", {"path": str(tokenizer_dir), "image_token": "<picture>", "caption_prompt": "<picture>"}).load("cpu")


def test_missing_tokenizer_folder_fails_the_job_before_any_work(media, tmp_path, cluster):
    manifest = write_manifest(media / "one.jsonl", [{"path": "media/image_000.png", "caption": "x"}])
    with pytest.raises(EncoderConfigError, match="not a folder"):
        encode(manifest, tmp_path / "store", cluster, f"text.path={tmp_path / 'absent'}")
    assert not (tmp_path / "store").exists()


def test_fingerprint_follows_tokenizer_files_and_options(tmp_path, tokenizer_dir):
    def digest(path, **options):
        encoder = build_encoder("tokenizer", {"path": str(path), **options})
        encoder.load("cpu")
        return encoder.fingerprint()["digest"]

    base = digest(tokenizer_dir)
    assert digest(tokenizer_dir) == base
    changed = tmp_path / "changed"
    shutil.copytree(tokenizer_dir, changed)
    config = json.loads((changed / "tokenizer_config.json").read_text())
    config["model_max_length"] = 77
    (changed / "tokenizer_config.json").write_text(json.dumps(config))
    assert digest(changed) != base
    assert digest(tokenizer_dir, caption_prompt="<image> describe:\n") != base
    assert digest(tokenizer_dir, max_length=99) != base


def test_chat_template_of_the_tokenizer_is_used(tmp_path, tokenizer_dir):
    templated = tmp_path / "templated"
    shutil.copytree(tokenizer_dir, templated)
    tok = train_tiny_bpe_tokenizer()
    tok.chat_template = "{% for m in messages %}<img>{{ m['role'] }}\n{{ m['content'] }}</s>\n{% endfor %}"
    tok.save_pretrained(templated)
    encoder = build_encoder("tokenizer", {"path": str(templated)})
    encoder.load("cpu")
    sample = TextSample(caption="", conversations=(("human", "<image> what?"), ("gpt", "a red square")), images=1)
    out = encoder.encode([sample])[0]
    ids, mask = out["input_ids"], out["target_mask"]
    assert decode(tok, ids) == "<img>user\n<image> what?</s>\n<img>assistant\na red square</s>\n"
    assert decode(tok, ids[mask == 1]).strip() == "a red square</s>"
    assert encoder.fingerprint()["preprocessing"]["template"] == "tokenizer-chat-template"


@pytest.mark.parametrize("preset", ["internvl2-2b", "llava-1.5-7b"])
def test_real_presets_load_and_ask_for_their_folders(preset):
    from mmcache.precompute.worker.specs import encoder_specs

    config = load_config(EncodeConfig, preset, "encode", [])
    assert config.vit["encoder"] in ("internvl_vision", "clip_vision") and config.text["encoder"] == "tokenizer"
    # The encoder options are checked on the client, before any worker starts: unset folders
    # are named there.
    with pytest.raises(ValueError, match="path"):
        encoder_specs(config)


def test_conversations_column_in_csv_is_a_json_string(tmp_path):
    import csv

    from mmcache.precompute.inputs.manifest import read_inputs

    (tmp_path / "a.png").write_bytes(b"png")
    turns = [{"from": "human", "value": "<image>\nhi"}, {"from": "gpt", "value": "hello"}]
    with open(tmp_path / "m.csv", "w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=["path", "caption", "conversations", "id"])
        writer.writeheader()
        writer.writerow({"path": "a.png", "caption": "", "conversations": json.dumps(turns), "id": "a"})
        writer.writerow({"path": "a.png", "caption": "", "conversations": json.dumps([{"from": "human"}]), "id": "b"})
    rows, rejects = read_inputs(str(tmp_path / "m.csv"))
    assert [r.conversations for r in rows] == [(("human", "<image>\nhi"), ("gpt", "hello"))]
    assert [(r.sample_id, r.reason[:17]) for r in rejects] == [("b", "conversation turn")]
