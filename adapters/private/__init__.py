"""The company's own GPU servers, declared by the ops team in a YAML file (README
"Private servers"): one offer per group of identical servers, in the `reserved` market."""
