"""docs/runbooks.md, generated from the runbooks the package ships (``policies/runbooks/``),
so the docs site, the API and the dashboard's runbook page say the same thing.

``python -m kvwatch.docs_runbooks > docs/runbooks.md`` (``make docs-runbooks``);
``tests/test_runbooks.py`` fails until the checked-in page matches."""

from __future__ import annotations

import sys

from collector.runbooks import kinds, runbook_text

COMMAND = "python -m kvwatch.docs_runbooks > docs/runbooks.md"

INTRO = f"""# Runbooks

*Generated from `policies/runbooks/*.md` by `{COMMAND}`; do not edit it by hand
(`tests/test_runbooks.py` fails until the page matches them).*

One runbook per rule kind, containment first: the engine flag to set, the
[gateway](gateway.md)'s mode, how to confirm with [`kvwatch verify`](verify.md), then
diagnosis and when to close. The same text is served as `GET /v1/runbooks/{{kind}}` (any
read token) and shown on the dashboard's runbook page (`/runbook?kind=KIND`), which
notifications link to when `KVWATCH_DASHBOARD_URL` is set. A pack can point a rule elsewhere
with its `runbook_url` ([rule fields](policies.md#rule-fields)). In the commands, upper-case
words (`URL`, `MODEL`, `DEPLOYMENT`, `ID`, `N`) are yours to fill in.
"""


def _demoted(markdown: str) -> str:
    """A runbook's headings one level down, under the page's own title."""
    return "\n".join(
        "#" + line if line.startswith("#") else line for line in markdown.rstrip().splitlines()
    )


def render() -> str:
    parts = [INTRO]
    parts += [_demoted(runbook_text(kind)) + "\n" for kind in kinds()]
    return "\n".join(parts)


def main() -> None:
    sys.stdout.write(render())


if __name__ == "__main__":
    main()
