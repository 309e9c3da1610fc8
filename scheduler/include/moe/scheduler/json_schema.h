// Structured outputs: a JSON Schema, JSON mode or a set of tools compiled to a Grammar (grammar.h)
// whose sentences are compact JSON texts (no whitespace between tokens) that the schema accepts.
//
// What a schema may hold: type (one or a list), properties, required, additionalProperties (only
// the declared properties are written; a schema there without properties makes a map), items,
// minItems, maxItems, enum, const, anyOf, allOf of one schema, $ref to "#/$defs/..." or
// "#/definitions/..." (recursion included), minLength, maxLength, pattern (a regular expression
// of literals, classes, ., \d \w \s and their negations, groups, |, and the quantifiers * + ? {n}
// {n,} {n,m}; anchored at both ends), and the annotations title, description, default, examples,
// $schema, $id, $comment, deprecated, readOnly and writeOnly. Anything else (minimum, maximum,
// multipleOf, format, oneOf, not, patternProperties, uniqueItems, ...) cannot be enforced while
// decoding and is refused with kInvalidArgument naming the keyword and where it is, rather than
// ignored. Integers have at most 16 digits, fractions 16 and exponents 2 (every number is a finite double).
//
// Thread-safety: plain functions; the grammars they return are immutable.
#pragma once

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "moe/scheduler/grammar.h"
#include "nlohmann/json.hpp"

namespace moe::scheduler {

// A JSON text valid against `schema`. `field` names the schema in messages ("response_format.
// json_schema.schema").
absl::StatusOr<std::shared_ptr<const Grammar>> CompileJsonSchema(const nlohmann::json& schema,
                                                                 const std::string& field);
// Any JSON object (response_format {"type": "json_object"}).
absl::StatusOr<std::shared_ptr<const Grammar>> JsonObjectGrammar();
// tool_choice "required": a JSON list of one or more calls [{"name": N, "parameters": {...}}], each
// naming one of `tools` (OpenAI's list) with arguments valid against its parameters schema.
absl::StatusOr<std::shared_ptr<const Grammar>> ToolCallsGrammar(const nlohmann::json& tools);

}  // namespace moe::scheduler
