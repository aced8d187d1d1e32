"""``rlmerge.extract_lora`` (issue #54 item 1) against independent truth: PEFT loads the adapter
and merges it into the base, and each factored module's update is then the best rank-r
approximation of the model's (numpy's SVD, Eckart–Young) to the adapter's bf16 rounding; the
modules saved whole come back exactly; the share it reports kept is the SVD's — held, or read from
the files as it is factored (``max_held_mib=0``)."""

import json

import numpy as np
import pytest

import rlmerge

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")


def _state(path):
    model = transformers.AutoModelForCausalLM.from_pretrained(str(path), torch_dtype=torch.float32)
    return model.state_dict()


@pytest.mark.parametrize("rank,max_held_mib", [(4, None), (16, None), (4, 0), (16, 0)])
def test_peft_merges_the_best_rank_r_update(demo, tmp_path, rank, max_held_mib):
    root, base, agents = demo
    out = tmp_path / f"lora{rank}"
    done = rlmerge.extract_lora(base, agents[0], out, rank=rank, max_held_mib=max_held_mib)
    assert done["modules"] and done["whole"]
    config = json.loads((out / "adapter_config.json").read_text())
    assert config["r"] == rank and config["lora_alpha"] == rank
    model = transformers.AutoModelForCausalLM.from_pretrained(str(base), torch_dtype=torch.float32)
    merged = peft.PeftModel.from_pretrained(model, str(out)).merge_and_unload().state_dict()
    b, a = _state(base), _state(agents[0])
    kept = {m["module"]: m["kept"] for m in done["modules"]}
    for module in kept:
        name = module + ".weight"
        d = (a[name] - b[name]).double().numpy()
        u, s, vt = np.linalg.svd(d, full_matrices=False)
        best = (u[:, :rank] * s[:rank]) @ vt[:rank]
        got = (merged[name] - b[name]).double().numpy()
        optimal = np.linalg.norm(d - best) / np.linalg.norm(d)
        error = np.linalg.norm(d - got) / np.linalg.norm(d)
        # The factors are stored in bf16: a few 1e-3 of the update at most.
        assert error <= optimal + 5e-3, (module, error, optimal)
        assert np.linalg.norm(got - best) <= 5e-3 * np.linalg.norm(d), module
        reported = np.sqrt((s[:rank] ** 2).sum() / (s ** 2).sum())
        assert abs(kept[module] - reported) < 1e-6, (module, kept[module], reported)
    for module in done["whole"]:
        name = module + ".weight"
        assert torch.equal(merged[name], a[name]), name


def test_bad_requests_are_usage_errors(demo, tmp_path):
    root, base, agents = demo
    for keywords in ({"rank": 0}, {"rank": -1}, {"rel_error": 2.0}, {"include": "("}, {"rank": 1.5},
                     {"max_held_mib": -1}, {"max_held_mib": 0.5}, {"max_held_mib": 2**70}):
        with pytest.raises(rlmerge.UsageError):
            rlmerge.extract_lora(base, agents[0], tmp_path / "out", **keywords)
        assert not (tmp_path / "out").exists()
