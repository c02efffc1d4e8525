"""One supplier record's way to the catalog: the rules of a record, normalization, row
quality, batch gates, resource mapping, field-level diffs, review of risky diffs, the
version-guarded publish, tombstones, and dead letters for every record that stops."""
