"""opfuse.save / opfuse.load: plans round-trip (in a fresh process, without the model),
outputs equal the fused module's; truncated, edited or mismatched files give a clear
LoadError; loading runs no pickle and no op outside the allowlists."""

import json
import os
import pickle
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import pytest
import torch
from kernel_testing import needs_onednn_bf16

import opfuse
from opfuse import persist
from opfuse.graph.dynamic import DynamicShapeError
from opfuse.models import load as load_model


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    loaded = load_model("bert-tiny", batch=2, seq=16)
    fused = opfuse.optimize(loaded.model, loaded.args, dynamic=True)
    path = tmp_path_factory.mktemp("plan") / "bert"
    opfuse.save(fused, path)
    return loaded, fused, path


def _copy(path: Path, tmp_path: Path) -> Path:
    import shutil
    dst = tmp_path / "copy"
    shutil.copytree(path, dst)
    return dst


def _rehash(root: Path) -> None:
    """Update the manifest's hashes after an edit (an attacker who rewrites both)."""
    manifest = json.loads((root / "manifest.json").read_text())
    for entry in manifest["plans"]:
        entry["sha256"] = {k: persist._sha256(root / f) for k, f in entry["files"].items()}
    (root / "manifest.json").write_text(json.dumps(manifest))


def _ids(batch, seq, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 1000, (batch, seq), generator=g)
    mask = torch.ones(batch, seq, dtype=torch.long)
    mask[0, seq // 2:] = 0
    return ids, mask


def test_round_trip_equal_outputs_and_report(saved):
    loaded, fused, path = saved
    back = opfuse.load(path)
    assert back.report.counts() == fused.report.counts() and back.report.dynamic == fused.report.dynamic
    for batch, seq in [(2, 16), (1, 1), (5, 77)]:
        args = _ids(batch, seq, seed=seq)
        with torch.no_grad():
            out, ref, eager = back(*args), fused(*args), loaded.model(*args)
        assert type(out) is type(ref)
        assert torch.equal(out.last_hidden_state, ref.last_hidden_state)
        torch.testing.assert_close(out.last_hidden_state, eager.last_hidden_state, atol=1e-4, rtol=1e-4)
    assert len(back.reports) == 1


def test_load_in_a_fresh_process_without_the_model(saved, tmp_path):
    loaded, fused, path = saved
    args = _ids(3, 40, seed=3)
    torch.save(args, tmp_path / "inputs.pt")
    with torch.no_grad():
        torch.save(fused(*args).last_hidden_state, tmp_path / "ref.pt")
    script = textwrap.dedent(f"""
        import time, torch
        t0 = time.perf_counter()
        import opfuse
        t1 = time.perf_counter()
        fused = opfuse.load({str(path)!r})
        t2 = time.perf_counter()
        ids, mask = torch.load({str(tmp_path / 'inputs.pt')!r}, weights_only=True)
        ref = torch.load({str(tmp_path / 'ref.pt')!r}, weights_only=True)
        with torch.no_grad():
            out = fused(ids, mask).last_hidden_state
        assert torch.equal(out, ref), (out - ref).abs().max()
        import sys
        assert "transformers.models.bert.modeling_bert" not in sys.modules  # no model code needed
        print("LOAD_S", t2 - t1)
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300,
                          env=dict(os.environ, HF_HUB_OFFLINE="1"))
    assert done.returncode == 0, done.stderr[-3000:]
    load_s = float(done.stdout.split("LOAD_S")[1])
    assert load_s < 5.0  # a second on an idle machine; generous for a loaded CI runner


def test_static_plan_round_trip_and_uncovered_signature(tmp_path):
    loaded = load_model("llama-tiny", batch=1, seq=12)
    fused = opfuse.optimize(loaded.model, loaded.args)
    back = opfuse.load(opfuse.save(fused, tmp_path / "llama"))
    with torch.no_grad():
        assert torch.equal(back(*loaded.args).last_hidden_state, fused(*loaded.args).last_hidden_state)
    with pytest.raises(opfuse.LoadError, match=r"no plan for inputs \[1, 13\]"):
        back(torch.randint(0, 100, (1, 13)))
    with pytest.raises(opfuse.LoadError, match="generate needs"):
        back.generate(loaded.args[0])


def test_dynamic_range_and_symbol_equality_are_checked(saved):
    _, _, path = saved
    back = opfuse.load(path)
    with pytest.raises(DynamicShapeError, match="outside the dynamic range"):
        back(*_ids(1, 600))
    ids, mask = _ids(2, 20)
    with pytest.raises(DynamicShapeError, match="one size"):
        back(ids, mask[:, :10].contiguous())


def test_no_pickle_while_loading(saved, monkeypatch):
    _, _, path = saved
    assert not [p for p in path.iterdir() if p.suffix in (".pt", ".pkl", ".pickle", ".bin")]

    def refuse(*_a, **_k):
        raise AssertionError("pickle used while loading")
    monkeypatch.setattr(pickle, "loads", refuse)
    monkeypatch.setattr(pickle, "load", refuse)
    monkeypatch.setattr(torch, "load", refuse)
    back = opfuse.load(path)
    with torch.no_grad():
        back(*_ids(2, 16))


def test_truncated_or_edited_files(saved, tmp_path):
    _, _, path = saved
    root = _copy(path, tmp_path)
    tensors = root / "plan0.safetensors"
    tensors.write_bytes(tensors.read_bytes()[:1000])
    with pytest.raises(opfuse.LoadError, match="SHA-256"):
        opfuse.load(root)
    _rehash(root)  # consistent hashes, truncated content: safetensors refuses it
    with pytest.raises(opfuse.LoadError, match="cannot read"):
        opfuse.load(root)
    (root / "manifest.json").write_text((root / "manifest.json").read_text()[:50])
    with pytest.raises(opfuse.LoadError, match="not valid JSON"):
        opfuse.load(root)
    with pytest.raises(opfuse.LoadError, match="no manifest.json"):
        opfuse.load(tmp_path / "nowhere")


def _call(graph):
    return next(n for n in graph["nodes"] if n["op"] == "call_function")


@pytest.mark.parametrize("edit, message", [
    (lambda g: _call(g).update(target="builtins::eval.default"), "not allowed"),
    (lambda g: _call(g).update(target="operator.attrgetter"), "not allowed"),
    (lambda g: _call(g).update(target="aten::no_such_op.default"), "has no op"),
    (lambda g: g["nodes"][0].update(name="x = __import__('os').system('true')  #"), "not an identifier"),
    (lambda g: next(n for n in g["nodes"] if n["op"] == "get_attr").update(target="__class__.__init__.x y"),
     "dotted identifier"),
    (lambda g: _call(g).update(op="call_module"), "not allowed"),
    (lambda g: g["pytree"].update(out_spec=g["pytree"]["out_spec"].replace(
        "transformers.modeling_outputs", "evil.module")), "registered pytree type"),
])
def test_edited_graph_with_consistent_hashes(saved, tmp_path, edit, message):
    """Someone who rewrites the graph and the manifest's hashes still cannot make load run
    anything but allowlisted ops: each edit is a clear LoadError."""
    _, _, path = saved
    root = _copy(path, tmp_path)
    graph = json.loads((root / "plan0.graph.json").read_text())
    edit(graph)
    (root / "plan0.graph.json").write_text(json.dumps(graph))
    _rehash(root)
    with pytest.raises(opfuse.LoadError, match=message):
        opfuse.load(root)


@pytest.mark.parametrize("field, value, message", [
    ("opfuse", "0.0.1", "written by opfuse 0.0.1"),
    ("torch", "1.13.0", "written with torch 1.13.0"),
    ("format", 99, "format 99"),
])
def test_other_versions_are_refused(saved, tmp_path, field, value, message):
    _, _, path = saved
    root = _copy(path, tmp_path)
    manifest = json.loads((root / "manifest.json").read_text())
    manifest[field] = value
    (root / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(opfuse.LoadError, match=message):
        opfuse.load(root)


def test_changed_schema_refused_and_other_cpu_warns(saved, tmp_path):
    _, _, path = saved
    root = _copy(path, tmp_path)
    manifest = json.loads((root / "manifest.json").read_text())
    name = next(iter(manifest["schemas"]))
    manifest["schemas"][name] = manifest["schemas"][name].replace("Tensor", "Scalar", 1)
    (root / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(opfuse.LoadError, match="has schema"):
        opfuse.load(root)
    manifest = json.loads((path / "manifest.json").read_text())
    manifest["cpu"] = "Some Other CPU"
    (root / "manifest.json").write_text(json.dumps(manifest))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        back = opfuse.load(root)
    assert any("planned on 'Some Other CPU'" in str(w.message) for w in caught)
    with torch.no_grad():
        back(*_ids(2, 16))


def test_save_refuses_what_it_cannot_write(tmp_path):
    loaded = load_model("bert-tiny", batch=2, seq=8)
    fused = opfuse.FusedModule(loaded.model, {})
    with pytest.raises(opfuse.SaveError, match="no plan yet"):
        opfuse.save(fused, tmp_path / "empty")


def test_tied_weights_stored_once(tmp_path):
    """GPT-2's LM head shares the token embedding: one tensor in the file, both restored."""
    from transformers import GPT2Config, GPT2LMHeadModel
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=300, n_positions=64,
                                       use_cache=False)).eval()
    ids = torch.randint(0, 300, (2, 10))
    fused = opfuse.optimize(model, (ids,))
    root = opfuse.save(fused, tmp_path / "gpt2")
    manifest = json.loads((root / "manifest.json").read_text())
    from safetensors import safe_open
    with safe_open(str(root / "plan0.safetensors"), "pt") as f:
        keys = set(f.keys())
    aliases = manifest["plans"][0]["aliases"]
    tied = {"lm_head.weight", "transformer.wte.weight"}
    assert len(tied & keys) == 1 and not (set(aliases) & keys), (keys, aliases)
    back = opfuse.load(root)
    with torch.no_grad():
        torch.testing.assert_close(back(ids).logits, model(ids).logits, atol=1e-4, rtol=1e-4)


def test_cli_optimize_save_and_load(tmp_path, capsys):
    from opfuse.cli import main
    out = tmp_path / "cli"
    assert main(["optimize", "bert-tiny", "--batch", "2", "--seq", "16", "--dynamic", "--save", str(out)]) == 0
    assert (out / "manifest.json").is_file()
    assert main(["load", str(out), "--batch", "3", "--seq", "21", "--repeat", "2"]) == 0
    text = capsys.readouterr().out
    assert "saved the plan to" in text and "forward on [3, 21], [3, 21]" in text and "one plan for" in text
    assert main(["load", str(tmp_path / "missing")]) == 2
    assert "no manifest.json" in capsys.readouterr().err


def test_plan_cache_reuses_the_stored_plan(tmp_path, monkeypatch):
    """The same model, weights, inputs and options optimize from the stored plan (no
    pipeline run), share the model's weights, and equal eager; a changed weight or option
    is a new key (planned again, never stale)."""
    from opfuse import pipeline
    loaded = load_model("bert-tiny", batch=2, seq=16)
    first = opfuse.optimize(loaded.model, loaded.args, dynamic=True, plan_cache=tmp_path)
    assert "planned and stored" in first.report.capture["plan_cache"]
    runs = []
    real = pipeline.run
    monkeypatch.setattr(pipeline, "run", lambda *a, **k: runs.append(1) or real(*a, **k))
    again = opfuse.optimize(loaded.model, loaded.args, dynamic=True, plan_cache=tmp_path)
    assert runs == [] and "reused" in again.report.capture["plan_cache"]
    assert again.report.counts() == first.report.counts()
    gm = next(iter(again._plans.values())).gm
    shared = [n for n, t in gm.named_buffers() if not n.startswith("opfuse_folded")
              and t.data_ptr() == dict(loaded.model.named_parameters()).get(n, torch.empty(0)).data_ptr()]
    assert shared  # the model's own weights, not copies from the file
    args = _ids(3, 33)
    with torch.no_grad():
        torch.testing.assert_close(again(*args).last_hidden_state, loaded.model(*args).last_hidden_state,
                                   atol=1e-4, rtol=1e-4)
    opfuse.optimize(loaded.model, loaded.args, dynamic=True, theta=0.5, plan_cache=tmp_path)
    assert runs == [1]  # another option: planned
    with torch.no_grad():
        loaded.model.encoder.layer[0].output.dense.weight[0, 0] += 1.0
    changed = opfuse.optimize(loaded.model, loaded.args, dynamic=True, plan_cache=tmp_path)
    assert runs == [1, 1] and "planned and stored" in changed.report.capture["plan_cache"]
    with torch.no_grad():
        torch.testing.assert_close(changed(*args).last_hidden_state, loaded.model(*args).last_hidden_state,
                                   atol=1e-4, rtol=1e-4)


def test_decoder_dynamic_round_trip(tmp_path):
    loaded = load_model("llama-tiny", batch=2, seq=16)
    fused = opfuse.optimize(loaded.model, loaded.args, dynamic=True)
    back = opfuse.load(opfuse.save(fused, tmp_path / "llama"))
    for batch, seq in [(1, 1), (3, 45)]:
        ids = torch.randint(0, loaded.model.config.vocab_size, (batch, seq))
        with torch.no_grad():
            out, eager = back(ids).last_hidden_state, loaded.model(ids).last_hidden_state
            assert torch.equal(out, fused(ids).last_hidden_state)
        torch.testing.assert_close(out, eager, atol=1e-4, rtol=1e-4)
    assert back.report.counts().get("rope", 0) > 0 and len(back.reports) == 1


@pytest.mark.parametrize("name, options, forms, op", [
    ("bert-tiny", {}, ("opfuse",), "opfuse.attention_bf16"),
    # the ATen form, called directly (on bf16 q/k/v from oneDNN's bf16 GEMMs)
    pytest.param("bert-tiny", {}, ("aten",), "aten.scaled_dot_product_attention", marks=needs_onednn_bf16),
    # nothing fused: plain add + LayerNorm after bf16 GEMMs, which becomes the bf16 SkipLayerNorm, in place
    pytest.param("minilm", {"theta": 1.5, "gemm": "onednn"}, ("opfuse",), "opfuse.add_layernorm_bf16_",
                 marks=needs_onednn_bf16),
])
def test_bf16_plan_round_trip(tmp_path, monkeypatch, name, options, forms, op):
    """A precision="bf16" plan (bf16 attention in either form, the fused bf16 SkipLayerNorm in
    place, prepacked bf16 weights) saves and loads with equal outputs."""
    from opfuse import precision as P
    from opfuse.kernels.cpu import attention_bf16 as A
    monkeypatch.setenv("OPFUSE_CACHE_DIR", str(tmp_path / "cache"))  # no region timings cached by other runs
    monkeypatch.setattr(P, "ATTENTION_FORMS", forms)
    monkeypatch.setattr(A, "aten_form_keeps_nonfinite", lambda: True)  # the form's mechanics on finite inputs
    monkeypatch.setattr(P, "_measure", lambda fp32, bf16, rows, warm=None: {"fp32": 2e-4, "bf16": 1e-4})
    monkeypatch.setattr("opfuse.cost.device.busy", lambda: "test: not cached")
    loaded = load_model(name, batch=2, seq=16)
    fused = opfuse.optimize(loaded.model, loaded.args, example_kwargs=loaded.kwargs, precision="bf16",
                            decide="rho", **options)
    targets = [n.target for n in next(iter(fused._plans.values())).gm.graph.nodes]
    namespace, name_ = op.split(".")
    assert getattr(getattr(torch.ops, namespace), name_).default in targets
    back = opfuse.load(opfuse.save(fused, tmp_path / "bf16"))
    with torch.no_grad():
        assert torch.equal(back(*loaded.args, **loaded.kwargs).last_hidden_state,
                           fused(*loaded.args, **loaded.kwargs).last_hidden_state)
    assert back.report.precision["end_to_end"]["min_cosine"] >= P.COSINE_MIN
