"""The doctor: measure why the GPU idles, name the bottleneck with numbers, and check its own advice.

``fastfeed doctor SCRIPT`` runs a training script under a watch (see ``fastfeed.doctor.cli``);
``with fastfeed.doctor.watch() as report:`` watches a loop in your own code (see ``fastfeed.doctor.watch``);
``fastfeed doctor --nproc-per-node N SCRIPT`` (or ``torchrun ... -m fastfeed doctor SCRIPT``) watches every rank of
a job and reports on the job (``fastfeed.doctor.jobreport``).

Every report prints as text and saves (``--out DIR``, ``report.save(DIR)``) as JSON, text, a PNG timeline and a
Perfetto trace; ``--html`` (``report.save(DIR, html=True)``, or ``report.html()`` for the string) adds
report.html, one self-contained page that opens offline: the verdict, a zoomable timeline (a lane per rank for a
job), the six questions, the advice with predicted against measured gains, and the what-ifs
(``fastfeed.doctor.html``).
"""

from .hooks import StopWatch
from .jobreport import JobReport
from .report import Report
from .verdict import Verdict, diagnose
from .watch import Watch, watch

__all__ = ["JobReport", "Report", "StopWatch", "Verdict", "Watch", "diagnose", "watch"]
