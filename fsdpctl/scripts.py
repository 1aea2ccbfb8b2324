"""The shell and batch scripts fsdpctl runs on the nodes, kept as jinja2 templates in a `templates/`
folder next to the module that runs each (as the Ansible roles keep theirs), where shellcheck can
read them (tests/fsdpctl/test_script_templates.py lints every one, rendered).

Rendering is strict: a value the caller did not pass fails at once (StrictUndefined) instead of
becoming an empty word in a script. Values that a script takes as data go through the `shquote`
filter (shlex.quote); numbers, and names the script itself defines, are written as they are.
"""

from __future__ import annotations

import shlex
from pathlib import Path

import jinja2

PACKAGE_DIR = Path(__file__).parent
"""Template names are paths under the fsdpctl package, e.g. `templates/slurm_job.sbatch.j2`."""

# trim_blocks/lstrip_blocks: a line holding only a `{% %}` or `{# #}` tag renders as nothing, so the
# templates read as the scripts they produce; keep_trailing_newline: a script ends as its file does.
_ENV = jinja2.Environment(loader=jinja2.FileSystemLoader(PACKAGE_DIR), undefined=jinja2.StrictUndefined,
                          trim_blocks=True, lstrip_blocks=True, keep_trailing_newline=True,
                          autoescape=False)
_ENV.filters["shquote"] = shlex.quote


def render_script(template: str, **values: object) -> str:
    """The script of `template` (a path under the fsdpctl package) with `values` filled in."""
    return _ENV.get_template(template).render(**values)
