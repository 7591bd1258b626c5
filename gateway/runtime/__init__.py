"""What runs beside requests, set up once per process: the configured tiers' engines (`tiers`), the policy
tuning schedule (`tuning`), a job on a period (`periodic`: the schedules' checks), and a quantized variant's
quality check (`model_quality`). A leaf: it imports no other gateway sub-package.
"""

__all__ = ["model_quality", "periodic", "tiers", "tuning"]
