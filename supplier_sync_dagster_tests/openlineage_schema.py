"""The OpenLineage run event's JSON schema, as the spec states it, for the events the sync sends.

``openlineage-python`` builds its classes from the spec's JSON schema but ships no schema file
(nor does any package of the client's on PyPI checked here: openlineage-integration-common,
openlineage-airflow, apache-airflow-providers-openlineage, dagster-openlineage). This restates
the spec's ``OpenLineage.json`` (2-0-2: ``RunEvent``, ``Run``, ``Job``, the datasets and
``BaseFacet``) and the facets the sync sends (``SchemaDatasetFacet`` 1-2-0,
``DataQualityAssertionsDatasetFacet``, ``DataQualityMetricsInputDatasetFacet``,
``ErrorMessageRunFacet``, ``JobTypeJobFacet``): their required fields, types and formats.
"""

from __future__ import annotations

from typing import Any

import jsonschema

_FACET = {"$ref": "#/$defs/BaseFacet"}


def _facet(required: list[str], properties: dict[str, Any]) -> dict[str, Any]:
    return {
        "allOf": [
            _FACET,
            {"type": "object", "properties": properties, "required": required},
        ]
    }


def _strings(*required: str, optional: tuple[str, ...] = ()) -> dict[str, Any]:
    """A facet of string fields."""
    return _facet(list(required), {name: {"type": "string"} for name in (*required, *optional)})


def _facets(**known: dict[str, Any]) -> dict[str, Any]:
    """A facets object: the known ones as stated, any other a facet."""
    return {"type": "object", "properties": known, "additionalProperties": _FACET}


_ASSERTION = {
    "type": "object",
    "properties": {
        "assertion": {"type": "string"},
        "success": {"type": "boolean"},
        "column": {"type": "string"},
        "severity": {"type": "string"},
        "name": {"type": "string"},
        "description": {"type": "string"},
        "expected": {"type": "string"},
        "actual": {"type": "string"},
        "params": {"type": "object"},
    },
    "required": ["assertion", "success"],
}

RUN_EVENT_SCHEMA: dict[str, Any] = {
    "$schema": "https://json-schema.org/draft/2020-12/schema",
    "$ref": "#/$defs/RunEvent",
    "$defs": {
        "RunEvent": {
            "type": "object",
            "properties": {
                "eventType": {"enum": ["START", "COMPLETE", "ABORT", "FAIL", "OTHER", "RUNNING"]},
                "eventTime": {"type": "string", "format": "date-time"},
                "run": {"$ref": "#/$defs/Run"},
                "job": {"$ref": "#/$defs/Job"},
                "inputs": {"type": "array", "items": {"$ref": "#/$defs/InputDataset"}},
                "outputs": {"type": "array", "items": {"$ref": "#/$defs/OutputDataset"}},
                "producer": {"type": "string", "format": "uri"},
                "schemaURL": {"type": "string", "format": "uri"},
            },
            "required": ["run", "job", "eventTime", "producer", "schemaURL"],
        },
        "Run": {
            "type": "object",
            "properties": {
                "runId": {"type": "string", "format": "uuid"},
                "facets": _facets(
                    errorMessage=_strings(
                        "message", "programmingLanguage", optional=("stackTrace",)
                    )
                ),
            },
            "required": ["runId"],
        },
        "Job": {
            "type": "object",
            "properties": {
                "namespace": {"type": "string"},
                "name": {"type": "string"},
                "facets": _facets(
                    jobType=_strings("processingType", "integration", optional=("jobType",))
                ),
            },
            "required": ["namespace", "name"],
        },
        "Dataset": {
            "type": "object",
            "properties": {
                "namespace": {"type": "string"},
                "name": {"type": "string"},
                "facets": {
                    "type": "object",
                    "properties": {
                        "schema": _facet(
                            [],
                            {
                                "fields": {
                                    "type": "array",
                                    "items": {
                                        "type": "object",
                                        "properties": {
                                            "name": {"type": "string"},
                                            "type": {"type": "string"},
                                            "description": {"type": "string"},
                                        },
                                        "required": ["name"],
                                    },
                                }
                            },
                        )
                    },
                    "additionalProperties": _FACET,
                },
            },
            "required": ["namespace", "name"],
        },
        "InputDataset": {
            "allOf": [
                {"$ref": "#/$defs/Dataset"},
                {
                    "type": "object",
                    "properties": {
                        "inputFacets": {
                            "type": "object",
                            "properties": {
                                "dataQualityMetrics": _facet(
                                    ["columnMetrics"],
                                    {
                                        "rowCount": {"type": "integer"},
                                        "bytes": {"type": "integer"},
                                        "columnMetrics": {"type": "object"},
                                    },
                                ),
                                "dataQualityAssertions": _facet(
                                    ["assertions"],
                                    {"assertions": {"type": "array", "items": _ASSERTION}},
                                ),
                            },
                            "additionalProperties": _FACET,
                        }
                    },
                },
            ]
        },
        "OutputDataset": {
            "allOf": [
                {"$ref": "#/$defs/Dataset"},
                {
                    "type": "object",
                    "properties": {
                        "outputFacets": {"type": "object", "additionalProperties": _FACET}
                    },
                },
            ]
        },
        "BaseFacet": {
            "type": "object",
            "properties": {
                "_producer": {"type": "string", "format": "uri"},
                "_schemaURL": {
                    "type": "string",
                    "format": "uri",
                    "pattern": "^https://openlineage\\.io/spec/",
                },
            },
            "required": ["_producer", "_schemaURL"],
        },
    },
}


def validate_run_event(event: dict[str, Any]) -> None:
    """Raises ``jsonschema.ValidationError`` when ``event`` is not a valid run event."""
    jsonschema.Draft202012Validator(
        RUN_EVENT_SCHEMA, format_checker=jsonschema.Draft202012Validator.FORMAT_CHECKER
    ).validate(event)
