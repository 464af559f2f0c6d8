-- Argo CD health check for gantry.dev/EnginePlugin
-- (resource.customizations.health.gantry.dev_EnginePlugin). Conditions from
-- crd/src/conditions.rs:
--   Accepted=False (AbiMismatch, EngineIdConflict, InvalidSpec) -> Degraded
--   Loaded=False (LoadErrors: a node pod refused the library)    -> Degraded
--   Loaded=True                                                  -> Healthy
--   Accepted=True, Loaded=Unknown (NotMounted: no pod uses it)   -> Healthy (nothing to load yet)
--   no status, or status for an older generation                 -> Progressing
local hs = {}
local function find(conditions, t)
  for _, c in ipairs(conditions) do
    if c.type == t then return c end
  end
  return nil
end

if obj.status == nil or obj.status.conditions == nil then
  hs.status = "Progressing"
  hs.message = "Waiting for the operator to report status"
  return hs
end
local generation = obj.metadata.generation
local observed = obj.status.observedGeneration
if generation ~= nil and observed ~= nil and observed < generation then
  hs.status = "Progressing"
  hs.message = "Waiting for the operator to observe generation " .. tostring(generation)
  return hs
end

local accepted = find(obj.status.conditions, "Accepted")
local loaded = find(obj.status.conditions, "Loaded")
if accepted ~= nil and accepted.status == "False" then
  hs.status = "Degraded"
  hs.message = (accepted.reason or "") .. ": " .. (accepted.message or "")
  return hs
end
if loaded ~= nil and loaded.status == "False" then
  hs.status = "Degraded"
  hs.message = (loaded.reason or "") .. ": " .. (loaded.message or "")
  return hs
end
if accepted ~= nil and accepted.status == "True" then
  hs.status = "Healthy"
  if loaded ~= nil then
    hs.message = (loaded.reason or "") .. ": " .. (loaded.message or "")
  else
    hs.message = accepted.message or ""
  end
  return hs
end
hs.status = "Progressing"
hs.message = "Waiting for the Accepted condition"
return hs
