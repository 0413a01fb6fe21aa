"""The kvwatch package's exceptions: one tree under :class:`KvwatchError`.

Errors of the parts kvwatch drives (the collector, the probe, the policies) keep their own
trees (:class:`collector.errors.CollectorError`, :class:`engine_probe.errors.ProbeError`,
:class:`policies.errors.PolicyError`); the CLI translates those into exit codes where it
calls them. :mod:`kvwatch.scrape` and :mod:`kvwatch.kv_events` keep theirs under
``ProbeError``, where they were before they moved here: they stand alone, importing nothing
of kvwatch's. A database a command cannot use (the driver's, SQLAlchemy's or Alembic's error)
is translated once for every command, by :class:`kvwatch.cli_common.KvwatchGroup`: one line
naming the database with its password hidden, and exit 2.
"""

from __future__ import annotations


class KvwatchError(Exception):
    """Base class of every error the kvwatch package itself raises on purpose.

    - :class:`kvwatch.gateway.errors.GatewayError` and its subclasses: answered to the
      gateway's client with their HTTP status and OpenAI's error body by the handler in
      :mod:`kvwatch.gateway.app`, and recorded as a rejected or failed request;
    - :class:`kvwatch.gateway.errors.NoTokenizeEndpoint`: the upstream has no ``/tokenize``;
      never leaves the gateway (it counts the prompt locally instead);
    - :class:`kvwatch.verify.session.CouldNotRun`, :class:`~kvwatch.verify.session.EndpointGone`
      and :class:`~kvwatch.verify.session.BudgetExhausted`: end a verification early;
      :func:`kvwatch.verify.run.verify` records them as the report's ``error``, and
      ``kvwatch verify`` exits 2 (could not run), or 1 when the run already has a finding
      (``EndpointGone`` records one before it is raised).
    """
