"""The limits card as a PDF, for contracts and reviews: the verdict per model first, in the
card's own words (UNSAFE in red, a current verification in green, the rest in amber), then
the figures behind it and the nodes. An open incident on the deployment comes before all of
it, in red."""

from __future__ import annotations

from typing import Any

from collector.reports.pdf import ReportPdf

_COLOURS = {
    "unsafe": (176, 30, 30),
    "failed": (176, 30, 30),
    "stale": (176, 30, 30),
    "verified": (20, 120, 50),
    "not_verified": (170, 100, 0),
}


def _n(v: Any) -> str:
    return "-" if v is None else f"{v:,}" if isinstance(v, int) else str(v)


def render_pdf(card: dict[str, Any]) -> bytes:
    pdf = ReportPdf(card["deployment_id"], "limits card")
    pdf.add_page()
    pdf.h1(f"Limits card: {card['deployment_id']}")
    pdf.para(f"Generated {card['generated_at']} by kvwatch.")
    pdf.ln(2)
    incident = card.get("open_incident")  # absent from a card made before incidents showed
    if incident is not None:
        pdf.set_text_color(*_COLOURS["unsafe"])
        pdf.set_font("DejaVu", "B", 11)
        pdf.multi_cell(0, 7, incident["text"], new_x="LMARGIN", new_y="NEXT")
        pdf.set_text_color(0, 0, 0)
        pdf.ln(2)
    if not card["models"]:
        pdf.para("No model of this deployment has reported a configuration or a verification.")
    for mod in card["models"]:
        said = mod["verdict"]
        pdf.set_font("DejaVu", "B", 11)
        pdf.multi_cell(0, 7, f"Model {mod['model_id']}", new_x="LMARGIN", new_y="NEXT", align="L")
        pdf.set_text_color(*_COLOURS.get(said["status"], (0, 0, 0)))
        pdf.set_font("DejaVu", "B", 10)
        pdf.multi_cell(0, 6, said["text"], new_x="LMARGIN", new_y="NEXT")
        pdf.set_text_color(0, 0, 0)
        v, last = mod["verified"], mod["latest_verification"]
        rows: list[tuple[str, Any]] = [
            ("Limit in force", mod["limit_in_force"]["text"]),
            ("Advertised context", f"{_n(mod['advertised_context'])} tokens"),
            ("Prefill pool", f"{_n(mod['prefill_pool_tokens'])} tokens"),
            (
                "Verified safe context",
                "not verified"
                if v is None
                else f"{_n(v['safe_context'])} tokens, {v['verified_at']} "
                f"(engine {v['engine_version'] or '-'})",
            ),
        ]
        if mod["stale"]:
            rows.append(("Verification status", "stale: " + "; ".join(mod["stale_reasons"])))
        if last is not None:
            rows.append(
                ("Latest verification", f"{last['id']}: {last['result']}, {last['verified_at']}")
            )
            if last["leak_pairs"]:
                pairs = ", ".join(last["leak_pairs"])
                rows.append(("Leaking tenants", f"{pairs} (owner->reader)"))
                rows.append(
                    (
                        "Smallest leaking prompt",
                        f"{_n(last['smallest_leaking_prompt_tokens'])} tokens",
                    )
                )
            if last["findings_by_kind"]:
                rows.append(
                    (
                        "Findings",
                        ", ".join(f"{k}: {n}" for k, n in sorted(last["findings_by_kind"].items())),
                    )
                )
        pdf.kv(rows)
        pools = mod["pool_capacity_per_node"]
        if pools:
            pdf.grid(
                ["node", "role", "pool capacity (tokens)"],
                [[node, p["role"], _n(p["capacity_tokens"])] for node, p in pools.items()],
                [60, 40, 60],
            )
        pdf.ln(3)
    if card["nodes"]:
        pdf.set_font("DejaVu", "B", 11)
        pdf.cell(0, 7, "Nodes", new_x="LMARGIN", new_y="NEXT")
        pdf.grid(
            ["node", "role", "model", "engine", "advertised", "pool", "since"],
            [
                [
                    c["node"],
                    c["role"],
                    c["model_id"],
                    f"{c['engine']} {c['engine_version']}",
                    _n(c["advertised_context"]),
                    _n(c["pool_capacity_tokens"]),
                    c["config_since"],
                ]
                for c in card["nodes"]
            ],
            [26, 18, 30, 30, 22, 20, 44],
        )
        pdf.ln(2)
        pdf.grid(
            ["node", "KV dtype", "prefix cache", "KV past the pool"],
            [[c["node"], c["dtype"], c["prefix_cache"], c["kv_offload"]] for c in card["nodes"]],
            [26, 20, 34, 110],
        )
    return bytes(pdf.output())
