"""Re-create the pinned schemas in this folder from the operators' repositories (README.md).

    python tests/unit/k8s_schemas/extract.py CRD_YAML VERSION OUT_JSON

Takes the ``openAPIV3Schema`` of ``VERSION`` from the CustomResourceDefinition in ``CRD_YAML``
(a multi-document file is fine) and writes it as JSON with the ``description`` texts left out
(they are most of the bytes and validate nothing); everything else is kept as published.
"""
import json
import sys

import yaml


def strip_descriptions(node):
    """``node`` (a schema) without its ``description`` keys; property names are kept, even one
    called "description"."""
    if isinstance(node, list):
        return [strip_descriptions(item) for item in node]
    if not isinstance(node, dict):
        return node
    out = {}
    for key, value in node.items():
        if key == "description" and isinstance(value, str):
            continue
        if key in ("properties", "patternProperties", "definitions") and isinstance(value, dict):
            out[key] = {name: strip_descriptions(sub) for name, sub in value.items()}
        else:
            out[key] = strip_descriptions(value)
    return out


def main(crd_yaml: str, version: str, out_json: str) -> None:
    with open(crd_yaml) as f:
        docs = [d for d in yaml.safe_load_all(f) if d and d.get("kind") == "CustomResourceDefinition"]
    for doc in docs:
        for ver in doc["spec"]["versions"]:
            if ver["name"] == version:
                schema = strip_descriptions(ver["schema"]["openAPIV3Schema"])
                with open(out_json, "w") as f:
                    json.dump(schema, f, indent=1, sort_keys=True)
                    f.write("\n")
                return
    sys.exit(f"no CustomResourceDefinition version {version!r} in {crd_yaml}")


if __name__ == "__main__":
    main(*sys.argv[1:])
