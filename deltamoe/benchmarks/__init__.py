"""`deltamoe bench`: run the side-by-side suites in bench/ and render the README table from their results.

`suites` finds and runs the scripts (each in its own process); `table` turns bench/results/*.json
into the markdown table between the README's bench-table markers.
"""
