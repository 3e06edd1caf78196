; HiveJet's Windows installer (NSIS 3).
;
; Build with installer/windows/build.ps1 (it makes the payload), or by hand:
;   makensis -DVERSION=0.1.0 -DPAYLOAD=<folder> -DOUTFILE=<setup.exe> installer/windows/hivejet.nsi
; PAYLOAD holds python\ (Python with HiveJet and its dependencies installed, PyTorch's CPU build included),
; hivejet.ico and hivejet.cmd. See docs/INSTALL.md.
;
; * Per-user install into %LOCALAPPDATA%\Programs\HiveJet: no administrator rights.
; * Start menu and (optional) desktop shortcuts run `pythonw -m app.firstrun launch`: on the first start it finds
;   the NVIDIA driver and offers the CUDA build of PyTorch (plus triton-windows), with a progress window.
; * Upgrade in place: a previous install's folder is reused; its Python environment is replaced as a whole,
;   the GPU download (gpu-cache) is kept so the GPU build is installed again without downloading it again.
; * The uninstaller removes the program and asks before it deletes models and conversations
;   (%LOCALAPPDATA%\hivejet); a silent uninstall (/S) keeps them.

Unicode true
ManifestDPIAware true

!ifndef VERSION
  !define VERSION "0.0.0"
!endif
!ifndef VIVERSION
  !define VIVERSION "0.0.0.0"
!endif
!ifndef PAYLOAD
  !error "PAYLOAD is not defined: makensis -DPAYLOAD=<folder with python\, hivejet.ico, hivejet.cmd>"
!endif
!ifndef OUTFILE
  !define OUTFILE "HiveJet-${VERSION}-setup.exe"
!endif

!define APP "HiveJet"
!define APP_KEY "Software\HiveJet"
!define UNINST_KEY "Software\Microsoft\Windows\CurrentVersion\Uninstall\HiveJet"
!define LAUNCH_EXE "$INSTDIR\python\pythonw.exe"
!define LAUNCH_ARGS "-m app.firstrun launch"
!define DATA_DIR "$LOCALAPPDATA\hivejet"

Name "${APP}"
Caption "${APP} ${VERSION} Setup"
OutFile "${OUTFILE}"
RequestExecutionLevel user
InstallDir "$LOCALAPPDATA\Programs\HiveJet"
InstallDirRegKey HKCU "${APP_KEY}" "InstallDir"
SetCompressor /SOLID lzma
BrandingText "${APP} ${VERSION}"
ShowInstDetails show

VIProductVersion "${VIVERSION}"
VIAddVersionKey "ProductName" "${APP}"
VIAddVersionKey "ProductVersion" "${VERSION}"
VIAddVersionKey "FileVersion" "${VERSION}"
VIAddVersionKey "FileDescription" "${APP} installer"
VIAddVersionKey "LegalCopyright" "HiveJet contributors (MIT)"

!include "MUI2.nsh"
!include "LogicLib.nsh"
!include "FileFunc.nsh"

Var PreviousVersion

!define MUI_ICON "${PAYLOAD}\hivejet.ico"
!define MUI_UNICON "${PAYLOAD}\hivejet.ico"
!define MUI_ABORTWARNING
!define MUI_WELCOMEPAGE_TEXT "This installs ${APP} ${VERSION} for your user account (no administrator rights needed).$\r$\n$\r$\nOn its first start HiveJet looks for an NVIDIA GPU and offers to download GPU support (about 2.8 GB). Without a suitable GPU it runs on the CPU.$\r$\n$\r$\nClick Next to continue."
!define MUI_FINISHPAGE_RUN "${LAUNCH_EXE}"
!define MUI_FINISHPAGE_RUN_PARAMETERS "${LAUNCH_ARGS}"
!define MUI_FINISHPAGE_RUN_TEXT "Start HiveJet now"

!insertmacro MUI_PAGE_WELCOME
!define MUI_PAGE_CUSTOMFUNCTION_PRE SkipDirectoryOnUpgrade
!insertmacro MUI_PAGE_DIRECTORY
!insertmacro MUI_PAGE_COMPONENTS
!insertmacro MUI_PAGE_INSTFILES
!insertmacro MUI_PAGE_FINISH

!insertmacro MUI_UNPAGE_CONFIRM
!insertmacro MUI_UNPAGE_INSTFILES

!insertmacro MUI_LANGUAGE "English"

Function .onInit
  ; Upgrade in place: install over the previous version, wherever it is.
  ReadRegStr $0 HKCU "${UNINST_KEY}" "InstallLocation"
  ReadRegStr $PreviousVersion HKCU "${UNINST_KEY}" "DisplayVersion"
  ${If} $0 != ""
  ${AndIf} ${FileExists} "$0\python\*.*"
    StrCpy $INSTDIR $0
  ${Else}
    StrCpy $PreviousVersion ""
  ${EndIf}
FunctionEnd

Function SkipDirectoryOnUpgrade
  ${If} $PreviousVersion != ""
    Abort
  ${EndIf}
FunctionEnd

Section "HiveJet (required)" SecApp
  SectionIn RO
  SetOutPath "$INSTDIR"
  ${If} $PreviousVersion != ""
    DetailPrint "Upgrading HiveJet $PreviousVersion to ${VERSION} in $INSTDIR"
  ${EndIf}
  ; The old Python environment goes as a whole (two versions' packages mixed would break it). Its files are
  ; locked while HiveJet runs.
  retry:
  ${If} ${FileExists} "$INSTDIR\python\*.*"
    ClearErrors
    RMDir /r "$INSTDIR\python"
    ${If} ${Errors}
      MessageBox MB_RETRYCANCEL|MB_ICONEXCLAMATION "HiveJet is still running (its files are in use).$\r$\nClose HiveJet, then click Retry." /SD IDCANCEL IDRETRY retry
      Abort "HiveJet is running: close it and run the installer again."
    ${EndIf}
  ${EndIf}

  File /r "${PAYLOAD}\*"
  WriteUninstaller "$INSTDIR\Uninstall.exe"

  CreateShortCut "$SMPROGRAMS\HiveJet.lnk" "${LAUNCH_EXE}" "${LAUNCH_ARGS}" "$INSTDIR\hivejet.ico" 0 SW_SHOWNORMAL "" "Run open language models on your own GPU"

  WriteRegStr HKCU "${APP_KEY}" "InstallDir" "$INSTDIR"
  WriteRegStr HKCU "${APP_KEY}" "Version" "${VERSION}"
  WriteRegStr HKCU "${UNINST_KEY}" "DisplayName" "${APP}"
  WriteRegStr HKCU "${UNINST_KEY}" "DisplayVersion" "${VERSION}"
  WriteRegStr HKCU "${UNINST_KEY}" "Publisher" "HiveJet"
  WriteRegStr HKCU "${UNINST_KEY}" "DisplayIcon" "$INSTDIR\hivejet.ico"
  WriteRegStr HKCU "${UNINST_KEY}" "InstallLocation" "$INSTDIR"
  WriteRegStr HKCU "${UNINST_KEY}" "UninstallString" '"$INSTDIR\Uninstall.exe"'
  WriteRegStr HKCU "${UNINST_KEY}" "QuietUninstallString" '"$INSTDIR\Uninstall.exe" /S'
  WriteRegDWORD HKCU "${UNINST_KEY}" "NoModify" 1
  WriteRegDWORD HKCU "${UNINST_KEY}" "NoRepair" 1
  ${GetSize} "$INSTDIR" "/S=0K" $0 $1 $2
  IntFmt $0 "0x%08X" $0
  WriteRegDWORD HKCU "${UNINST_KEY}" "EstimatedSize" "$0"
SectionEnd

Section "Desktop shortcut" SecDesktop
  SetOutPath "$INSTDIR"
  CreateShortCut "$DESKTOP\HiveJet.lnk" "${LAUNCH_EXE}" "${LAUNCH_ARGS}" "$INSTDIR\hivejet.ico" 0 SW_SHOWNORMAL "" "Run open language models on your own GPU"
SectionEnd

!insertmacro MUI_FUNCTION_DESCRIPTION_BEGIN
  !insertmacro MUI_DESCRIPTION_TEXT ${SecApp} "HiveJet with its own Python (nothing else on the computer is changed)."
  !insertmacro MUI_DESCRIPTION_TEXT ${SecDesktop} "A HiveJet shortcut on the desktop."
!insertmacro MUI_FUNCTION_DESCRIPTION_END

Section "Uninstall"
  Delete "$SMPROGRAMS\HiveJet.lnk"
  Delete "$DESKTOP\HiveJet.lnk"
  ClearErrors
  RMDir /r "$INSTDIR\python"
  ${If} ${Errors}
    MessageBox MB_OK|MB_ICONEXCLAMATION "Some files are in use (is HiveJet running?). Close HiveJet and run the uninstaller again to remove them." /SD IDOK
  ${EndIf}
  RMDir /r "$INSTDIR\gpu-cache"
  Delete "$INSTDIR\hivejet.ico"
  Delete "$INSTDIR\hivejet.cmd"
  Delete "$INSTDIR\README.txt"
  Delete "$INSTDIR\Uninstall.exe"
  RMDir "$INSTDIR"
  DeleteRegKey HKCU "${UNINST_KEY}"
  DeleteRegKey HKCU "${APP_KEY}"

  ; Models and conversations are the user's: ask (default No; a silent uninstall keeps them).
  ${If} ${FileExists} "${DATA_DIR}\*.*"
    MessageBox MB_YESNO|MB_ICONQUESTION|MB_DEFBUTTON2 "Also delete your HiveJet models and conversations?$\r$\n$\r$\n${DATA_DIR}$\r$\n$\r$\nChoose No to keep them for a later install. Models in a folder you picked yourself are kept either way." /SD IDNO IDNO keep_data
    RMDir /r "${DATA_DIR}"
    keep_data:
  ${EndIf}
SectionEnd
