"""Which node a step runs on: `DFLASH_NODE` (`dflash-assets worker --name` sets it), else the host name.

Every asset records it as output metadata `node` and says it in its compute logs, so the UI shows
where each range ran, whichever executor ran it.
"""

from __future__ import annotations

import os

from dagster import AssetExecutionContext

from dflash_assets import settings


def step_node(context: AssetExecutionContext) -> str:
    """This step's node, logged once (event log and compute logs)."""
    node = settings.node_name()
    context.log.info(f"{context.asset_key.to_user_string()} runs on node {node} (pid {os.getpid()})")
    return node
