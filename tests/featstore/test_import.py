"""mmcache import: real per-sample caches in the SimpleTuner, finetrainers, musubi-tuner and
MindSpeed-MM layouts, each with a bad file among them, into a store."""

from __future__ import annotations

import json
import pickle

import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import save_file

from mmcache import featstore
from mmcache.featstore.cli import cli
from mmcache.featstore.importer import import_cache


def tensors_equal(a, b) -> bool:
    return a.dtype == b.dtype and torch.equal(a.view(torch.int16) if a.dtype == torch.bfloat16 else a, b.view(torch.int16) if b.dtype == torch.bfloat16 else b)


class RunsCode:
    """A pickle that would run code when unpickled: weights_only loading must refuse it."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


def test_simpletuner_bare_tensors_and_a_corrupt_file(tmp_path):
    root = tmp_path / "vae"
    (root / "sub").mkdir(parents=True)
    want = {f"sub/img{i}": torch.randn(4, 8, 6).to(torch.bfloat16) for i in range(3)}
    for name, t in want.items():
        torch.save(t, root / f"{name}.pt")
    (root / "broken.pt").write_bytes(b"not a torch file at all")
    report = import_cache(root, str(tmp_path / "st"), layout_name="simpletuner", fields={"latent": "tensor"})
    assert (report.imported, report.rejected) == (3, 1)
    store = featstore.open(str(tmp_path / "st"))
    for name, t in want.items():
        assert tensors_equal(store.read(name.replace("/", ":"), format="torch")["latent"], t)  # sub/img0 -> sub:img0
    assert store.meta("sub:img0") == {"cache_item": "sub/img0"}
    rejects = store.rejects.to_pylist()
    assert rejects[0]["source"].endswith("broken.pt") and "does not load" in rejects[0]["reason"]
    assert store.fields["latent"].meta["fingerprint"]["imported"]["layout"] == "simpletuner"


def test_finetrainers_dicts_and_a_pickle_that_would_run_code(tmp_path):
    root = tmp_path / "ft"
    root.mkdir()
    want = {}
    for i in range(3):
        want[str(i)] = {"latents": torch.randn(16, 2, 4, 4).to(torch.bfloat16), "prompt_embeds": torch.randn(5 + i, 32, dtype=torch.float16)}
        torch.save(want[str(i)], root / f"{i}.pt")
    marker = tmp_path / "code-ran"
    (root / "evil.pt").write_bytes(pickle.dumps({"latents": RunsCode(str(marker))}))
    torch.save({"latents": torch.randn(16, 2, 4, 4).to(torch.bfloat16)}, root / "no_text.pt")
    report = import_cache(root, str(tmp_path / "st"), layout_name="finetrainers", fields={"latent": "latents", "text": "prompt_embeds"})
    assert (report.imported, report.rejected) == (3, 2) and not marker.exists()
    store = featstore.open(str(tmp_path / "st"))
    for name, sample in want.items():
        got = store.read(name, format="torch")
        assert tensors_equal(got["latent"], sample["latents"]) and tensors_equal(got["text"], sample["prompt_embeds"])
    reasons = {r["source"].rsplit("/", 1)[-1]: r["reason"] for r in store.rejects.to_pylist()}
    assert "does not load" in reasons["evil.pt"] and "no tensor matches 'prompt_embeds'" in reasons["no_text.pt"]


def test_musubi_latent_and_text_files_merge_by_item(tmp_path):
    root = tmp_path / "musubi"
    root.mkdir()
    want = {}
    for item in ("cat", "dog_2"):
        latent, text = torch.randn(16, 1, 8, 8).to(torch.bfloat16), torch.randn(7, 32).to(torch.bfloat16)
        save_file({"latents_1x8x8_bf16": latent}, str(root / f"{item}_0064x0064_wan.safetensors"))
        save_file({"varlen_t5_bf16": text}, str(root / f"{item}_wan_te.safetensors"))
        want[item] = (latent, text)
    save_file({"latents_1x8x8_bf16": torch.zeros(16, 1, 8, 8, dtype=torch.bfloat16)}, str(root / "cut_0064x0064_wan.safetensors"))
    (root / "cut_wan_te.safetensors").write_bytes(b"\x40\x00\x00\x00\x00\x00\x00\x00{\"varlen")  # truncated header
    report = import_cache(root, str(tmp_path / "st"), layout_name="musubi", fields={"latent": "latents_*", "text": "varlen_t5_*"})
    assert (report.imported, report.rejected) == (2, 1)
    store = featstore.open(str(tmp_path / "st"))
    for item, (latent, text) in want.items():
        got = store.read(item, format="torch")
        assert tensors_equal(got["latent"], latent) and tensors_equal(got["text"], text)
    assert "cut_wan_te.safetensors does not load" in store.rejects.to_pylist()[0]["reason"]


def test_mindspeed_features_with_data_jsonl_metadata_through_the_cli(tmp_path):
    root = tmp_path / "ms"
    (root / "features").mkdir(parents=True)
    rows, want = [], {}
    for i in range(2):
        want[f"v{i}"] = {"video_latent": torch.randn(4, 3, 4, 4, dtype=torch.float16), "prompt_ids": torch.arange(5 + i, dtype=torch.int32)}
        torch.save(want[f"v{i}"], root / "features" / f"v{i}.pt")
        rows.append({"file": f"features/v{i}.pt", "cap": f"clip {i}", "fps": 24})
    rows.append({"file": "features/missing.pt", "cap": "gone"})
    (root / "data.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    dst = str(tmp_path / "st")
    result = CliRunner().invoke(cli, ["import", str(root), dst, "--set", "layout=mindspeed", "--set", "fields.latent=video_latent",
                                      "--set", "fields.ids=prompt_ids"])
    assert result.exit_code == 0, result.output
    assert "imported 2 sample(s)" in result.output and "1 rejected" in result.output
    store = featstore.open(dst)
    assert store.meta("v1") == {"cache_item": "v1", "cap": "clip 1", "fps": 24}
    assert torch.equal(store.read("v1", format="torch")["ids"], want["v1"]["prompt_ids"])
    assert "missing.pt does not load" in store.rejects.to_pylist()[0]["reason"]


def test_cli_refuses_an_unknown_layout_in_one_line(tmp_path):
    result = CliRunner().invoke(cli, ["import", str(tmp_path), str(tmp_path / "st"), "--set", "layout=kohya"])
    assert result.exit_code != 0
    assert "layout 'kohya' is not one of ['finetrainers', 'mindspeed', 'musubi', 'simpletuner']" in result.output
    assert "Traceback" not in result.output


def test_live_and_train_modes_refuse_imported_fields_with_the_reason(tmp_path):
    from mmcache.train.live.reattach import EncoderRecordError, encoder_record

    root = tmp_path / "ft"
    root.mkdir()
    torch.save({"latents": torch.randn(4, 2, 2)}, root / "a.pt")
    import_cache(root, str(tmp_path / "st"), layout_name="finetrainers", fields={"latent": "latents"})
    with pytest.raises(EncoderRecordError, match=r"imported from a finetrainers cache .*encoders\.latent\.mode: cached"):
        encoder_record(featstore.open(str(tmp_path / "st")), "latent", {"encoder": "taef2", "path": "x"})


def test_an_import_reads_nothing_outside_its_folder_and_a_bad_line_is_a_reject(tmp_path):
    root, outside = tmp_path / "ms", tmp_path / "outside"
    (root / "features").mkdir(parents=True)
    outside.mkdir()
    secret = {"video_latent": torch.ones(4, 2, 2, 2)}
    torch.save(secret, outside / "secret.pt")
    torch.save({"video_latent": torch.zeros(4, 2, 2, 2)}, root / "features" / "good.pt")
    (root / "features" / "link.pt").symlink_to(outside / "secret.pt")
    (root / "features" / "evil.pt").write_bytes(pickle.dumps({"video_latent": RunsCode(str(tmp_path / "ran"))}))
    lines = [json.dumps({"file": "features/good.pt"}), json.dumps({"file": "../outside/secret.pt"}),
             json.dumps({"file": str(outside / "secret.pt")}), json.dumps({"file": "features/link.pt"}),
             json.dumps({"file": "features/evil.pt"}), "{not json", "[" * 100_000 + "]" * 100_000, json.dumps(["a", "list"])]
    (root / "data.jsonl").write_text("\n".join(lines) + "\n")
    report = import_cache(root, str(tmp_path / "st"), layout_name="mindspeed", fields={"latent": "video_latent"})
    assert (report.imported, report.rejected) == (1, 7) and not (tmp_path / "ran").exists()
    store = featstore.open(str(tmp_path / "st"))
    assert store.sample_ids() == ["good"] and float(store.read("good", format="torch")["latent"].abs().sum()) == 0
    reasons = [r["reason"] for r in store.rejects.to_pylist()]
    assert sum("resolves outside the cache folder" in r for r in reasons) == 3, reasons
    assert any("pickled objects other than tensors" in r and "weights_only" not in r for r in reasons), reasons
    assert sum("of data.jsonl is not JSON" in r for r in reasons) == 2 and any("is list, not an object" in r for r in reasons), reasons


def test_an_import_run_again_imports_only_what_is_left_and_refuses_another_store(tmp_path):
    """A killed import leaves the shards it committed; run again, it was refused ("already holds a
    feature store"). Now it reads only the items not committed or rejected; a store that is not
    this import (another layout or fields) is still refused."""
    from mmcache.featstore.errors import StoreExistsError

    root = tmp_path / "vae"
    root.mkdir()
    for i in range(4):
        torch.save(torch.full((2, 3), float(i)), root / f"img{i}.pt")
    (root / "broken.pt").write_bytes(b"not a torch file")
    out = str(tmp_path / "st")
    first = import_cache(root, out, layout_name="simpletuner", fields={"latent": "tensor"})
    assert (first.imported, first.rejected, first.already) == (4, 1, 0)
    for i in range(4, 6):  # the cache grew (or the first run was killed before these)
        torch.save(torch.full((2, 3), float(i)), root / f"img{i}.pt")
    again = import_cache(root, out, layout_name="simpletuner", fields={"latent": "tensor"})
    assert (again.imported, again.rejected, again.already) == (2, 0, 5)
    store = featstore.open(out)
    assert sorted(store.sample_ids()) == [f"img{i}" for i in range(6)] and store.num_rejected() == 1
    assert float(store.read("img5")["latent"][0, 0]) == 5.0
    with pytest.raises(StoreExistsError, match="not this import"):
        import_cache(root, out, layout_name="simpletuner", fields={"latent": "other"})
