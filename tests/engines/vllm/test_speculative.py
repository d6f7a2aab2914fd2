"""n-gram speculative decoding on the real CPU engine (a second engine, so in a subprocess): clean runs with
accepted and rejected drafts are silent, and a rejected draft's slot never verifies as committed: when the
worker is made to count one rejected draft as accepted, the canary reports ``token_mismatch`` at once."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys
import textwrap

_SCRIPT = textwrap.dedent(
    """
    import json, sys, warnings
    warnings.simplefilter("ignore")
    from vllm import SamplingParams
    from kvcanary.adapters.vllm import install, tiny
    from kvcanary.runtime import CanaryViolation

    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "prompt_lookup_min": 1}
    llm = tiny.start_engine(sys.argv[1], speculative_config=spec)
    runner = llm.llm_engine.engine_core.engine_core.model_executor.driver_worker.worker.model_runner
    pattern = [11, 12, 13, 14, 15, 16, 17, 18]
    prompts = [{"prompt_token_ids": (pattern * 12)[: 60 + i]} for i in range(6)]
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    seen = {"rejected": 0, "faulted": None}
    expected = {}

    def wrap(original, fault):
        def _update_states(so, *a, **k):
            cached = so.scheduled_cached_reqs
            for i, rid in enumerate(cached.req_ids):
                c = cached.num_computed_tokens[i]
                if rid in expected and c < expected[rid]:  # drafts of the last step were rejected
                    seen["rejected"] += expected[rid] - c
                    if fault and seen["faulted"] is None:
                        cached.num_computed_tokens[i] = c + 1  # the first rejected draft counted as accepted
                        seen["faulted"] = rid
            for rid, n in so.num_scheduled_tokens.items():
                start = next((r.num_computed_tokens for r in so.scheduled_new_reqs if r.req_id == rid), None)
                if start is None and rid in cached.req_ids:
                    start = cached.num_computed_tokens[cached.req_ids.index(rid)]
                expected[rid] = (start or 0) + n
            return original(so, *a, **k)
        return _update_states

    out = {}
    canary = install(llm, "log")
    runner._update_states = wrap(runner._update_states, False)
    llm.generate(prompts, params, use_tqdm=False)
    canary.flush()
    del runner._update_states
    out["clean"] = {"stats": canary.stats(), "features": canary.features(), "rejected": seen["rejected"]}
    canary.uninstall()
    llm.reset_prefix_cache()
    seen["rejected"], seen["faulted"] = 0, None
    expected.clear()
    canary = install(llm, "raise")
    runner._update_states = wrap(runner._update_states, True)
    try:
        llm.generate(prompts, params, use_tqdm=False)
        out["fault"] = {"raised": False}
    except CanaryViolation as exc:
        r = exc.report
        out["fault"] = {"raised": True, "counts": r.counts, "requests": [str(x) for x in r.affected_request_ids],
                        "faulted": seen["faulted"]}
    print("RESULT " + json.dumps(out))
    """
)


def test_ngram_drafts_clean_and_a_rejected_draft_never_verifies(model_dir: str, tmp_path: pathlib.Path) -> None:
    script = tmp_path / "spec.py"
    script.write_text(_SCRIPT)
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    run = subprocess.run(
        [sys.executable, str(script), model_dir], env=env, capture_output=True, text=True, timeout=400, check=False
    )
    lines = [x for x in run.stdout.splitlines() if x.startswith("RESULT ")]
    assert run.returncode == 0 and lines, run.stderr[-3000:]
    out = json.loads(lines[0][len("RESULT ") :])
    print(f"\nspeculative decoding: {out}")
    clean = out["clean"]
    assert clean["stats"]["violations"] == 0 and clean["stats"]["health_failures"] == 0, clean
    assert clean["features"]["draft_tokens"] >= 50, clean  # drafts were verified...
    assert clean["rejected"] >= 5, clean  # ...and some were rejected
    fault = out["fault"]
    assert fault["raised"], fault
    assert fault["counts"].get("token_mismatch", 0) >= 1, fault
    assert fault["faulted"] in fault["requests"], fault
