"""The one rule for secrets: which values are secret (from the environment, read when text is masked)
and how text holding one is masked."""

from __future__ import annotations

from dflash_assets.redaction import environment_secrets, redact, redact_value

ENVIRONMENT = {
    "AWS_SECRET_ACCESS_KEY": "aws-secret-value",
    "DFLASH_GENERATE_API_KEY": "sk-api-key-value",
    "DFLASH_CELERY_BROKER_URL": "amqp://worker:broker-pass-word@rabbit:5672//",
    "MY_SERVICE_TOKEN": "service-token-value",
    "DFLASH_MASK_TOKEN_ID": "248070",  # not a secret: its name only contains TOKEN
    "AWS_ACCESS_KEY_ID": "AKIAEXAMPLE",  # a key id is not secret
    "SHORT_PASSWORD": "ab",  # too short to mask without masking ordinary text
}


def test_secrets_are_the_credential_variables_and_every_password_inside_a_url():
    secrets = environment_secrets(ENVIRONMENT)
    assert set(secrets) == {"aws-secret-value", "sk-api-key-value", "broker-pass-word", "service-token-value"}
    assert secrets == sorted(secrets, key=len, reverse=True)  # a secret inside another is masked whole


def test_every_form_of_a_secret_is_masked_and_the_rest_of_the_text_kept():
    import json
    from urllib.parse import quote

    environment = {**ENVIRONMENT, "DB_PASSWORD": 'p@ss/"word"+1'}
    secrets = environment_secrets(environment)
    text = " | ".join(
        [
            "key aws-secret-value",
            f"quoted {quote(environment['DB_PASSWORD'], safe='')}",
            f"in JSON {json.dumps({'password': environment['DB_PASSWORD']})}",
            "broker amqp://worker:broker-pass-word@rabbit:5672//",
            "mask token 248070",
        ]
    )
    masked = redact(text, secrets)
    assert "aws-secret-value" not in masked and "broker-pass-word" not in masked
    assert "p%40ss" not in masked and "p@ss" not in masked
    assert "mask token 248070" in masked and "amqp://worker:***@rabbit:5672//" in masked
    # A password in a URL is masked even when the environment does not hold it.
    assert redact("http://user:hunter22@host/v1", []) == "http://user:***@host/v1"


def test_nested_fields_are_masked_keys_and_values():
    secrets = environment_secrets(ENVIRONMENT)
    fields = {"engine": "https://u:sk-api-key-value@host/v1", "list": ["aws-secret-value", 3], "n": 1.5}
    assert redact_value(fields, secrets) == {"engine": "https://u:***@host/v1", "list": ["***", 3], "n": 1.5}
