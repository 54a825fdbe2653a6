"""Your own assets, beside the product's: `dg scaffold defs dagster.asset my_asset.py` writes one here.

Every module and component folder under this one loads with the code location (`definitions.py`), so
what you add shows in `dg list defs`, `dagster definitions validate` and the UI. Keep imports at the
top of a module light, as the product's are: every process loads the code location, so torch and
store access belong inside an asset's body. See docs/your-assets.md.
"""
