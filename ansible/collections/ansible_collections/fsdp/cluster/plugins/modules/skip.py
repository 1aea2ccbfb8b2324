#!/usr/bin/python
"""Documentation stub: the work is done by the action plugin of the same name."""

from __future__ import annotations

DOCUMENTATION = r"""
---
module: skip
short_description: Report a task as skipped, with the reason
description:
  - Marks the task result as skipped (it counts as C(skipped) in the play recap) and prints the
    reason without needing -v. Use it where hardware a role configures is absent, so the run
    says what was left out and why instead of reporting success.
options:
  reason:
    description: What was skipped and why.
    type: str
    required: true
author:
  - fsdp-cluster contributors
"""

EXAMPLES = r"""
- name: Skip the NVIDIA driver (no GPU)
  fsdp.cluster.skip:
    reason: "NVIDIA driver not installed: no NVIDIA GPU (PCI vendor 0x10de) on this node"
  when: fsdp_hardware.gpu_count == 0
"""

RETURN = r"""
skip_reason:
  description: The reason given.
  returned: always
  type: str
"""
