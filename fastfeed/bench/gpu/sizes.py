"""How big each check runs: a GPU run's sizes, or a dry run's tiny ones."""

from __future__ import annotations

from dataclasses import dataclass

from .. import workloads


@dataclass(frozen=True)
class Sizes:
    """How big each check runs: a GPU run's sizes, or a dry run's tiny ones (``DRY``)."""

    shape: tuple = workloads.IMAGE_SHAPE  # uint8 items: 64 of them make a 9.6 MB batch
    batch_size: int = workloads.BATCH_SIZE
    workers: int = 8
    race_batches: int = 40
    race_sleep_ms: float = 50.0
    stage_batches: int = 40
    copy_sleep_ms: float = 20.0
    consumer_sleep_ms: float = 10.0
    h2d_batches: int = 60
    h2d_batch_size: int = 128  # 19 MB: the launch gap an event can catch before a copy is a small part of it
    copies: int = 50
    register_bytes: int = 1 << 30
    epoch_batches: int = 60
    host_step_s: float = 0.005
    nvml_s: float = 2.0
    step_ms: float = 60.0
    matrix: int = 4096
    stall_steps: int = 60
    doctor_s: float = 4.0
    gds_records: int = 512
    gds_record_floats: int = 1 << 18  # 1 MiB records
    gds_step_ms: float = 20.0
    dali_batches: int = 50
    jpeg_files: int = workloads.JPEG_FILES


DRY = Sizes(shape=(3, 16, 16), batch_size=8, workers=2, race_batches=24, race_sleep_ms=20.0, stage_batches=16,
            copy_sleep_ms=5.0, consumer_sleep_ms=2.0, h2d_batches=10, h2d_batch_size=8, copies=5,
            register_bytes=16 << 20, epoch_batches=10, host_step_s=0.001, nvml_s=0.3, step_ms=2.0, matrix=64,
            stall_steps=8, doctor_s=1.0, gds_records=64, gds_record_floats=1 << 14, gds_step_ms=2.0, dali_batches=3,
            jpeg_files=16)  # fmt: skip
