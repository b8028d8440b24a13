"""The GPU check: what fastfeed claims about pinned memory and the GPU, measured on one, with bars that can fail.

Run it on a GPU machine with ``bash scripts/gpu_check.sh`` (which also builds the extension and runs
tests/test_gpu.py), or ``python -m fastfeed.bench.suites.gpu`` / ``fastfeed bench gpu``. Each check prints a line
per figure, with the bar it is held to beside it; the JSON report goes to ``--out`` (default gpu-results/).

Checks (ids as in the report):
  pin_race       pin_memory=True without device=: each ``.cuda(non_blocking=True)`` queued behind ~50 ms of
                 kernels, its CPU batch dropped at once while workers wait for slots; every copy checksummed.
  stage_race     device="cuda" with the device stage's *copy* stream delayed before each copy, the consumer
                 slow too: every batch checksummed (the slot must stay out of the ring until its copy read it).
  h2d            the device stage's copy rate from ``loader.stats().h2d_p50_s``, beside cudaMemcpyAsync from a
                 registered ring slot, a pageable buffer and torch's own pinned memory.
  async          the host time of ``.to(non_blocking=True)`` from a ring slot against the copy's device time.
  register       cudaHostRegister and unregister time per GB, and the first epoch's ``next()`` latency of a
                 pin_memory loader against a later epoch's.
  other_device   a loader on cuda:1 leaves GPU 0 alone: no context of its process there, torch's memory on 0
                 unchanged (skipped, saying so, on a one-GPU machine).
  gds            reader="gds" (kvikio): stall fraction under a 20 ms step, kvikio's compat mode, aligned and
                 widened reads; the file fsync'ed, then dropped from the page cache (skipped without kvikio).
  nvml           NVML's PCIe rx and utilisation against a known load: pinned copies at a measured GB/s, then
                 a busy kernel.
  stall          the stall fraction of a ResNet-50-sized step (bf16 matmuls, ~60 ms) fed by fastfeed
                 (device="cuda") and by torch (pin_memory=True, .cuda(non_blocking=True)), same workers and data.
  doctor         fastfeed.doctor's verdict on three loops of known kind (compute, host_sync, launch).
  dali           the jpeg workload decoded by DALI's nvJPEG against torch + Pillow (skipped without DALI).

Every CUDA call goes through ``facade.Cuda``: ``--dry-run`` runs every check on a CPU against ``fake.FakeCuda``
(tensors on the CPU, fake streams, events and NVML; scripts/gpu_check.sh builds tests/fake_cudart.c for
registration), with tiny sizes. A dry run judges only what its fake models faithfully (the checksums of the two
race checks); its report says ``dry_run: true`` and no figure in it was measured on a GPU.

Modules: races (pin_race, stage_race), copies (h2d, async, register), devices (other_device, nvml), storage (gds),
feeding (stall, doctor, dali); harness (what the checks share), sizes, report (Check and the JSON report), facade
and fake (CUDA, real and on the CPU), main (the checks in order, their budgets, the tests, the exit code).

Exit status: 0 when every check and bar held; 1 when one failed (or a test did, or a check ran out of time);
2 without a CUDA device ("no CUDA device"); 3 when a GPU is present but this torch has no CUDA.
"""
