"""Report a task as skipped with a reason (see the module stub for documentation)."""

from __future__ import annotations

from ansible.errors import AnsibleActionFail
from ansible.plugins.action import ActionBase


class ActionModule(ActionBase):
    TRANSFERS_FILES = False
    _requires_connection = False
    _VALID_ARGS = frozenset(("reason",))

    def run(self, tmp=None, task_vars=None):
        result = super().run(tmp, task_vars)
        reason = self._task.args.get("reason")
        if not isinstance(reason, str) or not reason.strip():
            raise AnsibleActionFail("fsdp.cluster.skip needs a non-empty 'reason': what is skipped and why")
        result.update(skipped=True, changed=False, skip_reason=reason, msg=reason)
        # shown by the default callback without -v, like debug output
        result["_ansible_verbose_always"] = True
        return result
