"""The safe context of a model on a deployment: the prompt size the context_pressure rule,
the quarterly review and the dashboard's prompt-token lines measure prompts against."""

from __future__ import annotations

from policies.facts import DeploymentFacts, verified_nodes


def safe_context(d: DeploymentFacts, model_id: str) -> tuple[int | None, bool]:
    """(the context prompts are measured against, whether it is verified).

    A passing verification for the model whose settings still match every node serving it
    gives its verified safe context; otherwise min(advertised context, prefill pool), which
    is what the incident lacked: nothing compared the two."""
    v = d.verifications.get(model_id)
    serving = verified_nodes(d.configs.values(), model_id) or list(d.configs.values())
    if (
        v is not None
        and v.passed
        and v.verified_safe_context
        and not any(v.stale_against(c) for c in serving)
    ):
        return v.verified_safe_context, True
    bounds = [b for b in (d.advertised_context(model_id), d.prefill_pool_tokens()) if b]
    return (min(bounds) if bounds else None), False
