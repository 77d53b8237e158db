"""Code that exists for one lesson only, in a module named after that lesson. Shared code lives in the
package proper; these modules run experiments and draw figures that only their lesson needs."""
