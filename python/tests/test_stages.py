"""A mergekit user's recipes through the Python API (issue #53 items 2–4): ``rlmerge.run`` of a
mergekit-multi YAML equals its stages run by hand, byte for byte; a recipe's ``chat_template``
renders in transformers; a bf16 RAM+ merge says on stderr (and in its record) how much of its
boost bf16 kept."""

import json

import pytest

import rlmerge

THREE = """\
name: pair_a
merge_method: ties
base_model: {base}
parameters: {{density: 0.5}}
models:
  - model: {coding}
    parameters: {{weight: 1.0}}
  - model: {tool}
    parameters: {{weight: 1.0}}
---
merge_method: linear
models:
  - model: pair_a
    parameters: {{weight: 0.5}}
  - model: pair_b
    parameters: {{weight: 0.5}}
---
name: pair_b
merge_method: ram+
base_model: {base}
models:
  - model: {tool}
  - model: {memory}
"""


def test_three_stages_equal_the_stages_by_hand(demo, tmp_path):
    root, base, (coding, tool, memory) = demo
    text = THREE.format(base=base, coding=coding, tool=tool, memory=memory)
    recipe = tmp_path / "multi.yml"
    recipe.write_text(text)
    record = rlmerge.run(recipe, tmp_path / "out", device="cpu")
    assert [s["name"] for s in record["stages"]] == ["pair_a", "pair_b"]
    assert [a["path"] for a in record["agents"]] == ["stage:pair_a", "stage:pair_b"]
    docs = text.split("---\n")
    strip = lambda doc: "".join(l + "\n" for l in doc.splitlines() if not l.startswith("name:"))
    (tmp_path / "a.yml").write_text(strip(docs[0]))
    (tmp_path / "b.yml").write_text(strip(docs[2]))
    last = strip(docs[1]).replace("pair_a", str(tmp_path / "hand_a")).replace("pair_b", str(tmp_path / "hand_b"))
    (tmp_path / "c.yml").write_text(last)
    for name, out in (("a.yml", "hand_a"), ("b.yml", "hand_b"), ("c.yml", "hand")):
        rlmerge.run(tmp_path / name, tmp_path / out, device="cpu")
    made = (tmp_path / "out" / "model.safetensors").read_bytes()
    assert made == (tmp_path / "hand" / "model.safetensors").read_bytes()
    assert not [p for p in tmp_path.iterdir() if ".rlmerge-" in p.name]
    kept = tmp_path / "kept"
    rlmerge.run(recipe, tmp_path / "out2", device="cpu", intermediate_dir=kept)
    assert sorted(p.name for p in kept.iterdir()) == ["pair_a", "pair_b"]
    assert (tmp_path / "out2" / "model.safetensors").read_bytes() == made


def test_bad_stages_are_usage_errors(demo, tmp_path):
    root, base, (coding, tool, memory) = demo
    recipe = tmp_path / "circle.yml"
    recipe.write_text(
        f"name: a\nmerge_method: ram\nbase_model: {base}\nmodels: [{{model: b}}]\n---\n"
        f"name: b\nmerge_method: ram\nbase_model: {base}\nmodels: [{{model: a}}]\n---\n"
        "merge_method: linear\nmodels: [{model: a}]\n")
    with pytest.raises(rlmerge.UsageError, match="circle"):
        rlmerge.run(recipe, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_a_rounded_away_boost_is_said(demo, tmp_path, capfd):
    root, base, agents = demo
    record = rlmerge.merge(base, agents, method="ram+", out=tmp_path / "bf16", device="cpu")
    said = capfd.readouterr().err
    assert said.count("ram+ boost rounded away") == 3, said
    shares = [a["boost_rounded_away"] for a in record["agents"]]
    assert all(0 < s < 1 for s in shares), shares
    record = rlmerge.merge(base, agents, method="ram+", out=tmp_path / "f32", device="cpu",
                           out_dtype="float32")
    assert "rounded away" not in capfd.readouterr().err
    assert all("boost_rounded_away" not in a for a in record["agents"])
    written = json.loads((tmp_path / "f32" / "rlmerge_record.json").read_text())
    assert written["warnings"] == [] or all("rounded" not in w for w in written["warnings"])


@pytest.mark.parametrize("name,expected", [
    ("chatml", "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"),
    ("alpaca", "### Instruction:\nhi\n\n### Response:\n"),
    ("exaone", "[|system|][|endofturn|]\n[|user|]hi\n[|assistant|]"),
])
def test_a_named_chat_template_renders_in_transformers(demo, tmp_path, name, expected):
    transformers = pytest.importorskip("transformers")
    root, base, agents = demo
    recipe = tmp_path / "r.yml"
    recipe.write_text(f"merge_method: ram\nbase_model: {base}\nmodels: [{{model: {agents[0]}}}]\n"
                      f"chat_template: {name}\n")
    rlmerge.run(recipe, tmp_path / "out", device="cpu")
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(tmp_path / "out"))
    text = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False,
                                         add_generation_prompt=True)
    assert text == expected
