"""Planning a run before any GPU time: how many samples and tokens, the bytes in the store (bf16 and
fp8), staging, extraction hours, bandwidths, S3 requests and device memory per stage, with warnings
that name the setting to change (`dflash-assets plan`, and metadata on `tokenized_completions`).

May import every stage below it (`storage`, `conversations`, `target`, `extraction`, `drafter`,
`training`). `bench` imports it: `bench --gpu` saves its measurements where the plan reads them.
"""
