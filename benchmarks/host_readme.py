"""The host-time sections of benchmarks/README.md (``make_readme.py`` calls :func:`demo_section` and
:func:`host_section`): the GPU demo's host time per step by phase, and ``bench_host_step.py``'s records."""

from __future__ import annotations

import datetime
import functools
import json
import re
import subprocess
from pathlib import Path

HERE = Path(__file__).resolve().parent


DEMO_LINE = re.compile(
    r"host time in the canary: (?P<total>[\d.]+) ms per step \(median (?P<median>[\d.]+) ms; mean by phase, ms: "
    r"batch capture (?P<capture>[\d.]+), translation (?P<translate>[\d.]+), plan/verify/stamp (?P<launch>[\d.]+), "
    r"host step (?P<host_step>[\d.]+)\)"
)
DEMO_SHARE = re.compile(r"the canary's share of step time: (?P<share>[\d.]+)%")
DEMO_TIMED = re.compile(r"host time per step of each timed run: [\d., ]+ ms \(median (?P<median>[\d.]+) ms\)")


# What changed between the stored runs of the demo table, oldest first (rendered under it).
DEMO_NOTES = (
    "",
    "3d14a28 -> c8acec9 (issue 14, part 2): the step's plan/verify/stamp launches, validation and log snapshot "
    "replay from the canary's own CUDA graph (`runtime/step_graphs.py`: 657 of 720 dense steps replayed, the rest "
    "eager or captured), and each group's read-index translation is one Triton launch "
    "(`ops/kernels/translate.py`) instead of about two dozen torch ops. What is left per step is host work: "
    "numpy planning and the truth store's per-request loop (about 0.2 ms of dense under the profiler), the "
    "staging copy (0.14 ms), the translation launch (0.12 ms), the host step (0.07 ms): "
    "`results/gpu-demo/nvidia-h200-c8acec9-host-profile.txt`. The goals are not met.",
    "",
    "Issue 14's graph workload (`scripts/gpu/cb_qwen3_workload.py`, Qwen3-0.6B-shaped, asynchronous batching), "
    "a035a84 -> c8acec9: with CUDA graphs `host_step` no longer waits for the previous step's device work (pump "
    "polling, two steps behind): 16.4 -> 0.07 ms per step at batch 1 and 25.2 -> 0.08 ms at batch 32, the tap's "
    "median 19.8 -> 0.77 ms and 33.4 -> 1.28 ms; all four runs clean, verified == read "
    "(`results/cb-qwen3/nvidia-h200-c8acec9-cb_qwen3.json`).",
    "",
    "712ed1e -> 025eb0d (issue 14, part 2, continued): the translation kernel expands each row's span from its "
    "lengths and reads the step's index sizes from the device, so its launch joins the canary's step graph (one "
    "replay a step runs the translation too) and the host no longer builds or sends an array per verified "
    "entry; the truth store resends only the tokens of the recent tail that changed; the per-step stream switch "
    "and event record skip torch's device lookup; staging views are reused. Measured in one device call each "
    "(the rows 712ed1e and 025eb0d come from the same call): dense 0.66 -> 0.56 ms, hybrid 1.20 -> 1.05 ms "
    "(b2bf878, an earlier call on another machine: 0.58 and 0.82 ms). The mean over the run and the share "
    "against a canary-off run move by several points from call to call (the same 712ed1e code measured 0.71 "
    "and 0.66 ms, shares 0.0 % and 8.1 %), so compare rows of one call. What is left under the profiler "
    "(`results/gpu-demo/nvidia-h200-025eb0d-host-profile.txt`): the truth store's per-request loop, the "
    "staging copy, the eager steps' launches and the host step. The goals are not met. Issue 14's graph "
    "workload at 025eb0d: all four runs clean, verified == read, 0 health failures "
    "(`results/cb-qwen3/nvidia-h200-025eb0d-cb_qwen3.json`).",
    "",
    "a5a456e (the submitted code; translate.py split, no behaviour change) with 712ed1e again in one later call "
    "(`results/gpu-demo/nvidia-h200-a5a456e-run-with-712ed1e.txt`): dense 0.84 -> 0.75 ms (median 0.69 -> 0.61), "
    "hybrid 1.37 -> 1.14 ms (median 1.11 -> 0.81); the graph workload clean in all four runs "
    "(`results/cb-qwen3/nvidia-h200-a5a456e-cb_qwen3.json`). That machine was slower than the others for "
    "both commits.",
    "",
    "9fd5071 (the truth store's loop and History's 64-token copy, the geometry's constants cached): dense 0.52 "
    "ms (median 0.45), hybrid 0.90 ms (0.58), sliding 0.57 ms (0.46); the graph workload clean in all four runs "
    "(`results/cb-qwen3/nvidia-h200-9fd5071-cb_qwen3.json`); the compiled translation suite and the GPU tests "
    "passed (`results/gpu-demo/nvidia-h200-9fd5071-gputests.txt`). No 712ed1e run in that call.",
    "",
    "78f58dc (the truth store's write and gather join the translation's prelude, so they replay in the step graph "
    "too): dense 0.66 ms (median 0.48), hybrid 0.77 ms (0.50), sliding 0.53 ms (0.43); the graph workload clean in "
    "all four runs, its tap median 381 us at batch 1 and 579 us at batch 32 with graphs "
    "(`results/cb-qwen3/nvidia-h200-78f58dc-cb_qwen3.json`); the GPU tests passed. No 712ed1e run in that call.",
    "",
    "87a3e72 -> f1fb99a (issue 14: batch shape classes, `adapters/transformers_cb/batch_shapes.py`): each step's "
    "rows and tokens are padded to a power of two of at least 16 (inert padding) and the truth's writes run "
    "before the step graph, so its key follows the shape class: steps that ran eagerly on the dense demo 130 -> 7 "
    "of 720 (`results/gpu-demo/*-graph-keys-dense.txt`), plan/verify/stamp 168 -> 81 us (dense) and 333 -> 142 "
    "us (hybrid) in one call. Translation rose 253 -> 426 us in that call, but f1fb99a ran first and the machine "
    "was slower then (its canary-off run too: 3.08 s against 2.79 s), so the rows of that call "
    "(`results/gpu-demo/nvidia-h200-f1fb99a-run-with-87a3e72.txt`) do not settle the net effect. Under the "
    "profiler the step total was the same (889 against 897 us, "
    "`results/gpu-demo/nvidia-h200-{f1fb99a,87a3e72}-host-profile.txt`); what the padding adds to the "
    "translation per step is an eager truth write (6.8 us) and a few small numpy and view ops "
    "(`results/gpu-demo/nvidia-h200-f1fb99a-op-costs.txt`). The graph workload clean in all four runs "
    "(`results/cb-qwen3/nvidia-h200-f1fb99a-cb_qwen3.json`), the GPU tests passed. The goals are not met.",
    "",
    "e95cd83 (the submitted code: f1fb99a with the staging back to one pinned buffer a step and a helper split "
    "out) against 87a3e72 in one call, the dense demo in the order new, old, old, new "
    "(`results/gpu-demo/nvidia-h200-e95cd83-run-with-87a3e72.txt`): mean 0.48 and 0.56 ms against 0.62 and 0.65 "
    "ms (-18 %), median 0.46 and 0.53 against 0.44 and 0.48 ms (+8 %): the padding adds about 35 us to a "
    "replayed step and saves the eager steps' launches. Hybrid at e95cd83: 0.64 ms (median 0.58); its 87a3e72 run "
    "was cut off by the end of the session's device time. The GPU tests passed at e95cd83 "
    "(`results/gpu-demo/nvidia-h200-e95cd83-gputests.txt`).",
    "",
    "028fccd-8eaf950 (the host step's copy and event record through cuda-python's runtime bindings, "
    "`runtime/cuda_calls.py`; the stream switch through torch's C entry points; per-phase medians and the tap "
    "thread's CPU time in the adapter's stats). `bench_host_step.py` in one call, new, old, old, new: host_step "
    "13.2 / 18.2 us (one / two groups) and 14.8 / 15.5 us against d26c4cc's 22.0 / 21.6 and 26.1 / 26.2 us "
    "(`results/nvidia-h200-{028fccd,d26c4cc}-host.json`, all four runs in "
    "`results/cb-qwen3/nvidia-h200-028fccd-run.log`); "
    "the pieces: copy 2.2-3.9 us through the bindings against 3.3-5.9 through torch, record 1.0-1.8 against "
    "2.8-5.4, a query as cheap through torch (kept). The demo at 4afe3cf and d26c4cc in one call, new first "
    "(`results/gpu-demo/nvidia-h200-{4afe3cf,d26c4cc}-demo_*.txt`): dense 0.74 against 0.64 ms, hybrid 0.69 "
    "against 0.64 ms; the translation, whose code is the same in both, read 0.53 against 0.45 ms (dense), so run order "
    "and machine moved that call by a fifth and it does not settle the change. Issue 14's graph workload against "
    "78f58dc in one call (`results/cb-qwen3/nvidia-h200-4afe3cf-cb_qwen3.json`, `...-cb_qwen3-old-78f58dc.json`): "
    "clean, verified == read, but the tap's median is 815 us against 625 at batch 1 and 1,312 against 1,157 us at "
    "batch 32: the batch shape classes of f1fb99a cost this workload what they save the demo (padding to 16 rows "
    "and tokens, the truth's write out of the graph). Its tap is CPU-bound: the tap thread's CPU time is 972-1,087 "
    "us of 998-1,120 us at batch 1, the same with OMP_NUM_THREADS=1 "
    "(`results/cb-qwen3/nvidia-h200-8eaf950-threads-run.log`), and a warm profile shows no hotspot, every torch "
    "call costing 15-30 us there against 1-8 us alone (`results/cb-qwen3/nvidia-h200-8eaf950-cbprof.txt`). "
    "The goals are not met.",
    "",
    "8ec308f -> c7da061 -> 59d8c4a (issue 14, part 2): why those torch calls cost 15-30 us in the engine. The "
    "probe (`results/cb-qwen3/nvidia-h200-8ec308f-cb_qwen3.json`) found no mode, hook or thread: the calls cost the "
    "same inside the tap and outside it in that process. The cause is that the canary's step runs between two "
    "forwards of the model with every CPU cache cold, and there each distinct numpy function or torch call it "
    "touches costs tens of microseconds; `bench_translate.py --cold` reproduces it on any CPU (this sandbox's, "
    "`results/cpu-translate/`: the same one-launch translation at batch 1, 5 and 32 takes 115, 107 and 266 us in a "
    "loop and 436, 561 and 602 us with the caches evicted between steps; 8ec308f cold, 671, 485 and 821 us, a "
    "noisy comparison that leaves out the CUDA-only changes). So the one-launch path's per-row "
    "values are now plain Python (`array.array`, no numpy), the staging's pinned buffers are its own (no allocator "
    "call, no numpy view; the copy through `runtime/cuda_calls.py`), and the host step reads its scalars as plain "
    "words and skips a synchronize its query made redundant. The demo in one call, 59d8c4a, 8ec308f, 59d8c4a "
    "(`results/gpu-demo/nvidia-h200-59d8c4a-run-with-8ec308f.txt`): dense 0.43, 0.45, 0.40 ms; hybrid 0.50, "
    "0.75, 0.56 ms; in an earlier call, c7da061, 8ec308f, c7da061: dense 0.56, 0.73, 0.46 ms; hybrid 0.67, 0.91, "
    "0.83 ms. Issue 14's graph workload (`results/cb-qwen3/nvidia-h200-{8ec308f,59d8c4a}-cb_qwen3.json`, two "
    "calls): the tap's median 1,051 -> 370 us at batch 1 with graphs, 1,520 -> 615 us at batch 32, 1,036 -> "
    "587 and 1,437 -> 634 us eagerly; all runs clean, verified == read. The goals (150 and 250 us) are not met. "
    "`bench_host_step.py` (a hot loop) read 8.4 / 8.1 us at 8ec308f and 11.2 / 13.5 us at 59d8c4a, in two calls "
    "and not side by side (a third call was refused); its pieces ran faster in the later call (the torch copy 3.6 "
    "against 6.5 us), so the host step's own Python in a loop may have grown with 59d8c4a's event query through the "
    "bindings: to be settled in one call.",
    "",
    "d0f14df -> c12100e (issue 14, part 2): steady steps. Most steps of a serving loop are the last step's batch "
    "with every row one token further, on the same engine buffers (transformers' static tensors). Such a step now "
    "stages its new values where the last step's were and hands out the last translation and its launches again "
    "(`adapters/transformers_cb/steady_step.py`: no group planning, launch binding or keying; three distinct torch "
    "calls), the staging lays its arrays out once as they are packed, and the manager reuses a handed-again step's "
    "graph key with its hash. The demo in one call, c12100e then 2dcc5ae "
    "(`results/gpu-demo/nvidia-h200-c12100e-run-with-2dcc5ae.txt`): dense 0.30 against 0.40 ms (median 0.25 "
    "against 0.36), hybrid 0.46 against 0.65 ms; the share of step time 5.1 and 5.2 % against 16.9 and 20.3 %. "
    "An earlier call, d0f14df (the token copy in the translation kernel, the truth's write as a prelude kernel, "
    "batch keys by identity) then 2dcc5ae: dense 0.49 against 0.41 ms, hybrid 0.46 against 0.52 ms "
    "(`results/gpu-demo/nvidia-h200-d0f14df-run-with-2dcc5ae.txt`); `bench_host_step.py` in that call 11.0 / 10.6 "
    "us at d0f14df against 15.0 / 15.9 us at 2dcc5ae. Issue 14's graph workload at c12100e "
    "(`results/cb-qwen3/nvidia-h200-c12100e-cb_qwen3.json`): the tap's median 474 us at batch 1 with graphs, 721 "
    "at batch 32, 669 and 912 us eagerly, all clean with verified == read, and no better than before: the workload "
    "runs transformers' async batching, which alternates two sets of input buffers, so no step was steady. c459c4e "
    "keeps a translation per buffer set; on this sandbox's CPU (`bench_translate.py --cold --kernel-path "
    "--buffer-sets`, `results/cpu-translate/cpu-733a9b4-*`, two rounds) a step at batch 1, 5 and 32 takes "
    "366-393, 312-357 and 398-504 us on fresh tensors and 222-253, 218-307 and 280-440 us when steady, on one "
    "buffer set or two. Not yet measured on the device (the stop's device time ran out). The goals (150 and 250 "
    "us) are not met.",
    "",
    "c459c4e (a translation kept per engine buffer set) measured at 2378bf7 against c12100e in one call "
    "(`results/cb-qwen3/nvidia-h200-2378bf7-cb_qwen3*.json`): the graph workload's tap median 358 against 627 us "
    "at batch 1 with graphs, 676 against 904 at batch 32, 790 against 1,180 eagerly at batch 32.",
    "",
    "2378bf7 -> d655836 (issue 14, part 2): a steady step sets its values in place "
    "(`adapters/transformers_cb/steady_region.py`: the staged arrays the full step packed, kept as one int64 array "
    "laid out as the staging buffer's first bytes, set and sent with the truth's writes), its engine tensors are "
    "checked by address and dtype (contiguity when the translation is kept), and a full step's translation is keyed "
    "only when a later step matches its batch. On this sandbox's CPU (`results/cpu-translate/cpu-{2378bf7,36ebf22}-"
    "cold-steady*`, cold, two rounds, one and two buffer sets) a steady step at batch 1, 5 and 32 takes 155-199, "
    "181-202 and 304-322 us against 221-265, 293-307 and 304-451. On the device, each call runs both commits: "
    "issue 14's graph workload at c44dc46 against 2378bf7 (`results/cb-qwen3/nvidia-h200-c44dc46-cb_qwen3*.json`), "
    "the tap's median 277 against 425 us at batch 1 with graphs (translation 165 against 281), 658-676 at batch "
    "32 both, 600 against 702 eagerly; 62 of 65 steps steady at batch 1 and 54 of 73 at batch 32; all runs clean, "
    "verified == read. At d655836 (`results/cb-qwen3/nvidia-h200-d655836-cb_qwen3*.json`, a slower machine: "
    "every phase of both commits ran longer) 537 against 565, 771 against 829 and 742 against 843 us. The demo "
    "(`results/gpu-demo/nvidia-h200-d655836-run-with-2378bf7.txt`): dense 0.36 against 0.42 ms, hybrid 0.49 "
    "against 0.62, sliding 0.32 (against 0.47 at 2378bf7 in the first call, "
    "`results/gpu-demo/nvidia-h200-2378bf7-run-with-c12100e.txt`); steady steps 448 of 720, 179 of 352 and 462 "
    "of 560, so the full steps (a batch that changed) now cost most of the translation. The share of step time "
    "is now the median of three alternating pairs of timed runs (`demo_timing.py`): one pair had moved it by "
    "tens of points between calls. It still swings within a call (dense 0.0, 1.7 and 23.2 % over its three "
    "pairs; sliding's canary-off runs took longer than its canary runs): the engine's run time varies more "
    "than the canary costs. Medians at d655836: 1.7 % dense, 11.6 % hybrid, 6.4 % sliding. 3646e73 (a review: "
    "shared helpers, no behaviour change) passed the GPU tests and ran the dense demo alone, on a faster machine: "
    "0.29 ms, 448 of 720 steps steady, share 14.9 % (pairs 17.6, 0.0, 14.9). The goals (150 and 250 us, at most "
    "5 %) are not met.",
    "",
    "a6c3e29 -> fe91f28 (issue 14, part 2; no device was lent in that stop, so measured on the sandbox's CPU only): "
    "a steady step is any step of a kept shape class on the same engine buffers, not only the last batch a token "
    "further. The staged region sets every row's table row and lengths and zeroes the padding rows of a smaller "
    "batch, the launches' keys no longer hold the key offsets' length (the kernel reads the sizes from the "
    "staging), the request ids are replaced where they changed, the steady state is kept per shape class (up to "
    "8), and a sliding group's writes to the trash by design are masked by a staged mask of the class's token "
    "count, so a prefill chunk is steady too. `steady_coverage.py` runs the demo's workloads with the translator "
    "laid out as on CUDA, its launches under Triton's interpreter (`results/cpu-dry-run-{a6c3e29,6a428c0}-"
    "steady.json`): steady steps 448 -> 716 of 720 (dense), 179 -> 347 of 352 (hybrid), 462 -> 556 of 560 "
    "(sliding); the old counts equal the GPU demo's; the same verified slots, no violation. The translation "
    "phase's mean on that CPU (caches cold after the interpreter's work) 151 -> 129, 219 -> 176 and 152 -> 152 "
    "us: a steady step there still costs 120-170 us of cold Python (the truth's plan per row, the engine tensors' "
    "sizes and addresses, the staging). The device figures are to be measured.",
    "",
    "c714279 -> 073b90e (issue 14, part 2; again no device, so measured on the sandbox's CPU only): what a steady "
    "step costs cold is close to how many distinct functions and builtins it touches (each costs microseconds the "
    "first time after a forward: a lone `max(...)` took 6 us there), not how much it computes. So the steady path "
    "is tried first, in one function (`translate.StepTranslator._again`) that reads the engine's tensors once "
    "(`steady_step.engine_reading`: addresses, dtypes, index sizes), finds the kept state in one call "
    "(`KeptSteps.find`) and leaves every unusual step to the full path; the truth plan's usual row makes no call "
    "and keeps the window it built; the shape class is looked up; the truth update, `RowPlan`, `HostBatch` and "
    "`Translation` are plain or slotted classes; the store's rows are reused by a stamp; a sliding model builds "
    "its trash masks only when a query overflows a window; and the region rewrites table rows and padding only "
    "where rows came or went. A test pins the distinct Python functions a steady step runs (18 dense, 21 with a "
    "window). `bench_translate.py --cold --kernel-path` (`results/cpu-translate/cpu-{c714279,e85d84f,073b90e}-"
    "cold-steady*`, one and two buffer sets, two rounds): a steady step at batch 1, 32, 64 and 256 takes 70-77, "
    "116-134, 169-210 and 552-647 us at 073b90e (69-74, 113-127, 180-207 and 506-654 at e85d84f) against 98-104, "
    "165-180, 257-311 and 804-883 at c714279. The demo's workloads (`steady_coverage.py`, "
    "`results/cpu-dry-run-{c714279,073b90e}-steady.json`, caches cold after the interpreter's work): the "
    "translation phase's mean 117 -> 91 us (dense), 173 -> 137 (hybrid) and 141 -> 115 (sliding), the capture "
    "19 -> 17, 29 -> 26 and 21 -> 19 us; one run each, and a run moves by about 10 us. a6d6b9b builds a window's "
    "trash mask without numpy (a steady prefill chunk of a sliding model touched numpy for it: its median 240 -> "
    "155 us in the hybrid workload): 97, 123 and 107 us (`results/cpu-dry-run-a6d6b9b-steady.json`; the dense "
    "code is the same as 073b90e's). The device figures (and whether the dense model's 150 us are met) are to be "
    "measured.",
    "",
    "1560e54 -> 2842a39 (issue 14, part 2; the first device calls since c714279). At 1560e54 "
    "(`results/gpu-demo/nvidia-h200-1560e54-*`): dense 0.23 ms a step (median 0.20; translation 135 us, "
    "plan/verify/stamp 41, host step 38, capture 18), hybrid 0.36 (203, 82, 47, 32), sliding 0.28; 716 of 720, 347 "
    "of 352 and 556 of 560 steps steady; shares 2.8, 20.1 and 3.8 %. On CUDA a steady step ran eight more distinct "
    "Python functions than on the CPU (the GPU tests' count, 26 against 18: the staging's take of a pinned buffer, "
    "its free check and event query, the copy's lambda and memcpy, the record). ca9ccf7 makes a copy and its "
    "event record one call (`runtime/cuda_calls.py`'s `Transfer`, for the pump and the staging), 3365fc1 launches "
    "the canary's step graphs through cuda-python (`CudaCalls.graph_launch`), 2842a39 trims the truth plan's usual "
    "row (warm 282 -> 189 us at 256 rows on the sandbox; cold, unchanged within noise). At 2842a39 "
    "(`results/gpu-demo/nvidia-h200-2842a39-*`, another machine of the same kind): dense 0.20 ms (median 0.18; "
    "translation 119, plan/verify/stamp 31, host step 33, capture 16), hybrid 0.32 (183, 67, 40, 30), sliding "
    "0.27; shares 11.9 % (pairs 11.9, 0.0, 31.9), 16.0 % (12.2, 23.4, 16.0) and 0.0 % (4.9, 0.0, 0.0): the "
    "engine's run time still varies more than the canary costs. Where the hybrid's share goes beyond the tap's host "
    "time (`scripts/gpu/share_probe.py`, `results/gpu-demo/nvidia-h200-2842a39-share-probe-hybrid.txt`): the engine "
    "synchronises about eight times a step itself; the only synchronising calls the canary added were 486 a run, "
    "the host block numbers of mirrored offloads and restores built straight onto CUDA (queued through pinned "
    "memory since 0c843f1, not yet measured on a device); mirroring a run's 338 offload copies one by one took "
    "0.09 s under the profiler. The goals (150 and 250 us, at most 5 %) are not met.",
    "",
    "70d657b (one call on an H100, `results/gpu-demo/nvidia-h100-80gb-hbm3-70d657b-*`): the GPU tests passed (13, "
    "and 50 with 2 skipped), the mirror's among them; dense 0.33 ms a step (median 0.30), hybrid 0.66 (0.44), "
    "sliding 0.37 (0.33), shares 1.8, 10.3 and 7.7 % over five pairs. That machine's host CPU ran the same code "
    "about 1.6 times slower than the H200 machines' (translation 193 against 119 us on dense), so its rows compare "
    "with each other, not with the H200's. The share probe (`...-share-probe-{hybrid,dense}.txt`) counts the same "
    "synchronising calls with the canary as without it: 0c843f1 removed the last ones the canary made. Under the "
    "probe's profiler the engine's own calls ran about 10-20 % longer in the canary's runs (its linear layers 0.48 "
    "against 0.43 s on dense) while the canary made no call between them: the tap's host time does not account for "
    "the whole share, and what does is not yet known (the caches the tap's cold Python evicts is the lead). After "
    "that call (no device was lent again): an offload's mirror is one scatter a field instead of a dozen device ops "
    "per copied run (430151e), the stream switch a slotted class (35241c3), the restore wrapper skips its per-row "
    "scan while nothing is offloaded (207320c), the tap timer one commit a step (35a5053), the demo prints each "
    "timed run's host time (229a3f6) and `scripts/gpu/capture_costs.py` times a step graph's capture piece by "
    "piece (9be51f9): to be measured. The goals (150 and 250 us, at most 5 %) are not met.",
)


@functools.cache
def _commit_time(commit: str) -> int:
    """When a stored run's commit was made (rows in history order, the same in every clone); 0 if unknown."""
    out = subprocess.run(["git", "show", "-s", "--format=%ct", commit], cwd=HERE, capture_output=True, text=True)
    return int(out.stdout.strip() or 0) if out.returncode == 0 else 0


def demo_section() -> list[str]:
    """The GPU demo's host time per step by phase (scripts/gpu/demo_gpu.sh), one row per stored run."""
    rows = []
    for f in sorted(HERE.glob("results/gpu-demo/*-demo_*.txt")):
        text = f.read_text()
        m, share, timed = DEMO_LINE.search(text), DEMO_SHARE.search(text), DEMO_TIMED.search(text)
        if m is None:
            continue
        gpu, commit, model = f.stem.rsplit("-", 2)[0], f.stem.split("-")[-2], f.stem.split("demo_")[-1]
        runs = "-" if timed is None else f"{float(timed['median']) * 1000:.0f}"
        rows.append((model, commit, m, "-" if share is None else share["share"], f, gpu, runs))
    if not rows:
        return []
    lines = ["", "## Host time per step on the GPU demo (`scripts/gpu/demo_gpu.sh`)", ""]
    lines.append(
        "The canary's host (Python) time per verified step of `kvcanary demo --device cuda --baseline` (2-layer "
        "random-weight models, 64 + 8 prompts x 2 sequences), mean by phase in microseconds, and its share of the "
        "step time against the same workload with the canary off. Goals (issue 14): at most 150 us (dense) and "
        "250 us (hybrid) per step, a share of at most 5 % on every model. `total` and the phases are the clean run's "
        "means; `timed runs` the median of the timed canary runs' means (from 229a3f6; each run a new install, so "
        "each captures its own step graphs). The host CPU differs with the machine: compare rows of one GPU and call."
    )
    lines += ["", "| model | gpu | commit | total us | median us | capture | translation | plan/verify/stamp "
              "| host step | timed runs us | share % | source |",
              "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---|"]  # fmt: skip
    for model, commit, m, share, f, gpu, runs in sorted(rows, key=lambda r: (r[0], _commit_time(r[1]), r[1])):
        us = {k: float(v) * 1000 for k, v in m.groupdict().items()}
        lines.append(
            f"| {model} | {gpu} | {commit} | {us['total']:.0f} | {us['median']:.0f} | {us['capture']:.0f} "
            f"| {us['translate']:.0f} | {us['launch']:.0f} | {us['host_step']:.0f} | {runs} | {share} "
            f"| `{f.relative_to(HERE)}` |"
        )
    lines += DEMO_NOTES
    return lines


def host_section() -> list[str]:
    """Host (Python) time per step of the runtime on the GPU path (benchmarks/bench_host_step.py)."""
    hosts = []
    for f in sorted(HERE.glob("results/*.json")):
        d = json.loads(f.read_text())
        hosts += [(d["meta"], f, r) for r in d["records"] if str(r.get("scenario", "")).startswith("host_step")]
    if not hosts:
        return []
    date = max(m["date"] for m, _, _ in hosts)
    dates = {m["date"] for m, _, _ in hosts if _same_call(m["date"], date)}
    lines = ["", f"## Host time per step (`bench_host_step.py`), {date}", ""]
    lines.append(
        "Target: at most 15 us of host (Python) work per step on the GPU path with graphs. Rows: every result "
        "stored within two hours of the newest (the newest session's device calls; one file per call, and a "
        "call may time two commits side by side: compare within a call, machines differ by up to 2x)."
    )
    lines += ["", "| scenario | commit | median us | p20 | p80 | target | source |", "|---|---|---:|---:|---:|---|---|"]
    for m, f, r in hosts:
        if m["date"] not in dates:
            continue
        verdict = "meets" if r["median_us"] <= 15 else "misses"
        lines.append(
            f"| {r['scenario']} | {m['commit']} | {r['median_us']:.1f} | {r['p20_us']:.1f} | {r['p80_us']:.1f} "
            f"| {verdict} <= 15 us | `{f.relative_to(HERE)}` |"
        )
    return lines + _launch_rows(dates)


def _same_call(date: str, newest: str) -> bool:
    """Whether a result stored at ``date`` came from the device call that stored the newest (at ``newest``)."""
    gap = datetime.datetime.fromisoformat(newest) - datetime.datetime.fromisoformat(date)
    return gap <= datetime.timedelta(hours=2)


def _launch_rows(dates: set[str]) -> list[str]:
    """The same run's eager before_forward + after_forward (an engine without CUDA graphs pays it per step)."""
    rows = []
    for f in sorted(HERE.glob("results/*.json")):
        d = json.loads(f.read_text())
        if d["meta"]["date"] in dates:
            rows += [(d["meta"], f, r) for r in d["records"] if str(r.get("scenario", "")).startswith("launch_eager")]
    if not rows:
        return []
    lines = ["", "Eager `before_forward` + `after_forward` of the same run (one validation per group, three Triton "
             "launches per group, the bookkeeping ops; no CUDA graph), and one bare verify launch with no host "
             "checks (Triton's own launch path):", ""]  # fmt: skip
    lines += [
        "| scenario | commit | median us | p20 | p80 | bare launch us | source |",
        "|---|---|---:|---:|---:|---:|---|",
    ]
    for m, f, r in rows:
        lines.append(
            f"| {r['scenario']} | {m['commit']} | {r['step_median_us']:.1f} | {r['step_p20_us']:.1f} "
            f"| {r['step_p80_us']:.1f} | {r['verify_launch_median_us']:.1f} | `{f.relative_to(HERE)}` |"
        )
    return lines
