"""Data frames built from the collector's JSON, shared by the pages that draw them (a page's
script runs when imported, so pages never import each other)."""

from __future__ import annotations

import pandas as pd

from dashboard import ui
from dashboard.client import JSON


def occupancy_frame(items: list[JSON]) -> pd.DataFrame:
    df = pd.DataFrame(
        items,
        columns=[
            "deployment_id",
            "node",
            "role",
            "bucket_start_us",
            "samples",
            "used_avg",
            "used_max",
            "free_min",
            "capacity",
        ],
    )
    df["time"] = ui.us_to_time(df["bucket_start_us"])
    df["node"] = df["node"] + " (" + df["role"].fillna("?") + ")"
    df["occupancy"] = df["used_max"] / df["capacity"].where(df["capacity"] > 0)
    return df
