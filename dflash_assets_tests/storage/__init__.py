"""Tests of the storage stage: the store on both backends, the uploader, the manifest."""
